"""What tracing costs: the same offline workload through the engine with tracing off and
on (every step's spans recorded, as `lane serve --trace` records them), alternated, in
one run; prints throughput of each and the ratio.

    python benchmarks/trace_overhead.py [--num-prompts 32] [--output-len 64] [--rounds 3]

The last line is a JSON object of the headline figures.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_throughput import check_quiet  # noqa: E402

from lane import LLM, SamplingParams  # noqa: E402
from lane.tracing import tracer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(args.input_len)]}
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm = LLM(enable_prefix_caching=False, max_model_len=2048, show_progress=False)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    check_quiet()
    best = {"off": 0.0, "on": 0.0}
    spans = 0
    for r in range(args.rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):  # alternate: drift hits both
            tracer.enabled = mode == "on"
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            tok_s = args.num_prompts * args.output_len / (time.perf_counter() - t0)
            if mode == "on":
                spans = len(tracer.drain())
            best[mode] = max(best[mode], tok_s)
            print(f"round {r + 1} tracing {mode:>3}: {tok_s:7.1f} output tok/s", flush=True)
    tracer.enabled = False
    ratio = best["on"] / best["off"]
    print(f"\nbest of {args.rounds}: off {best['off']:.1f} tok/s, on {best['on']:.1f} tok/s "
          f"({spans} spans a run); on / off = {ratio:.3f} ({(1 - ratio) * 100:+.1f}% cost)")
    print(json.dumps({"tracing_off_tok_s": round(best["off"], 1), "tracing_on_tok_s": round(best["on"], 1),
                      "ratio": round(ratio, 3), "spans_per_run": spans}))


if __name__ == "__main__":
    main()

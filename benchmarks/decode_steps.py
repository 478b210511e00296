"""Decode step cost against batch size: M sequences decoding together, M = 1..16 and 32, for
the quantized path (`--quantization auto`) and today's float32 path (`none --dtype float32`),
same build, same run, on the embedded SmolLM2 Q4_1. A step's cost must grow smoothly with M:
no step from M to M+1 may cost more than 1.15x the one before.

    python benchmarks/decode_steps.py [--configs auto:float32,none:float32] [--tokens 32]

Each M: M distinct 32-token prompts decode --tokens steps together; every engine step is timed
and the step's cost is the median over the steps where all M decode. The M values run
interleaved over --rounds rounds (forwards, then backwards), and each M keeps its median
round: the machine's noise (neighbours' load, how much of the weights the shared L3 still
holds) moves whole rounds by +-30 %, and a best round is a lucky one. The last line is a JSON object: per
config, ms per step by M, each step's M -> M+1 ratio (the median over rounds of the round's
own ratio: M and M + 1 run back to back) and the worst, and auto / none per M.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

MS = list(range(1, 17)) + [32]
RUN = r"""
import json, statistics, sys, time
from lane import LLM, SamplingParams
q, dtype, n, ms, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]), int(sys.argv[5])
llm = LLM(dtype=dtype, quantization=q, show_progress=False, max_model_len=1024, max_num_seqs=64,
          kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False)
def run(m, out):
    params = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
    for i in range(m):
        llm._add_request({"prompt_token_ids": [100 + 37 * i + j for j in range(32)]}, params)
    times = []
    while llm.output_processor.has_unfinished():
        t = time.perf_counter()
        llm._step()
        times.append(time.perf_counter() - t)
    return statistics.median(times[2:-1])  # not the prefill step, its first decode or the last
run(4, 8)
per_round = {m: [] for m in ms}
for r in range(rounds):
    for m in ms if r % 2 == 0 else ms[::-1]:
        per_round[m].append(1e3 * run(m, 3 + n))
for m in ms:
    print(f"M={m:2d} {statistics.median(per_round[m]):7.2f} ms/step (rounds {min(per_round[m]):.2f}.."
          f"{max(per_round[m]):.2f})", file=sys.stderr, flush=True)
print(json.dumps(per_round))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="auto:float32,none:float32",
                    help="quantization:dtype pairs, comma-separated")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed per M")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved passes over the M values")
    args = ap.parse_args()
    out = {}
    for cfg in args.configs.split(","):
        q, dtype = cfg.split(":")
        print(f"{cfg}:", flush=True)
        p = subprocess.run([sys.executable, "-c", RUN, q, dtype, str(args.tokens), json.dumps(MS),
                            str(args.rounds)],
                           stdout=subprocess.PIPE, text=True, env={**os.environ, "LANE_LOGGING_LEVEL": "WARNING"})
        if p.returncode:
            sys.exit(f"{cfg} failed")
        per_round = {int(k): v for k, v in json.loads(p.stdout.strip().splitlines()[-1]).items()}
        steps = {m: statistics.median(v) for m, v in per_round.items()}
        # M and M + 1 run back to back in a round, so a round's own ratio cancels the drift
        # between rounds; the step's ratio is the median of those
        ratios = {m: statistics.median(b / a for a, b in zip(per_round[m], per_round[m + 1])) for m in range(1, 16)}
        worst = max(ratios, key=ratios.get)
        print("  M -> M+1: " + " ".join(f"{m}:{r:.2f}" for m, r in ratios.items()))
        print(f"  worst step M={worst} -> {worst + 1}: {ratios[worst]:.2f}x (target <= 1.15)")
        out[cfg] = {"ms_per_step": {m: round(v, 2) for m, v in steps.items()},
                    "step_ratio": {m: round(r, 3) for m, r in ratios.items()},
                    "worst_ratio": round(ratios[worst], 3), "worst_at": worst}
    if len(out) == 2:
        (a, ra), (b, rb) = out.items()
        out["speedup"] = {m: round(rb["ms_per_step"][m] / ra["ms_per_step"][m], 2) for m in MS}
        print(f"{b} / {a} per M: {out['speedup']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()

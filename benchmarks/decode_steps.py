"""Decode step cost against batch size: M sequences decoding together, M = 1..16 and 32, for
the quantized path (`--quantization auto`) and today's float32 path (`none --dtype float32`),
same build, same run, on the embedded SmolLM2 Q4_1. A step's cost must grow smoothly with M:
no step from M to M+1 may cost more than 1.15x the one before.

    python benchmarks/decode_steps.py [--configs auto:float32,none:float32] [--tokens 32]

Each M: M distinct 32-token prompts, timed for 1 and for 1 + --tokens output tokens (best of
two); the difference over --tokens is the step. The last line is a JSON object: per config,
ms per step by M, the worst M -> M+1 ratio, and auto / none per M.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

MS = list(range(1, 17)) + [32]
RUN = r"""
import json, sys, time
from lane import LLM, SamplingParams
q, dtype, n, ms = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
llm = LLM(dtype=dtype, quantization=q, show_progress=False, max_model_len=1024, max_num_seqs=64,
          kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False)
def run(m, out):
    prompts = [{"prompt_token_ids": [100 + 37 * i + j for j in range(32)]} for i in range(m)]
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=out, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t
run(4, 4)
steps = {}
for m in ms:
    steps[m] = 1e3 * (min(run(m, 1 + n) for _ in range(2)) - min(run(m, 1) for _ in range(2))) / n
    print(f"M={m:2d} {steps[m]:7.2f} ms/step", file=sys.stderr, flush=True)
print(json.dumps(steps))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="auto:float32,none:float32",
                    help="quantization:dtype pairs, comma-separated")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed per M")
    args = ap.parse_args()
    out = {}
    for cfg in args.configs.split(","):
        q, dtype = cfg.split(":")
        print(f"{cfg}:", flush=True)
        p = subprocess.run([sys.executable, "-c", RUN, q, dtype, str(args.tokens), json.dumps(MS)],
                           stdout=subprocess.PIPE, text=True, env={**os.environ, "LANE_LOGGING_LEVEL": "WARNING"})
        if p.returncode:
            sys.exit(f"{cfg} failed")
        steps = {int(k): v for k, v in json.loads(p.stdout.strip().splitlines()[-1]).items()}
        ratios = {m: steps[m + 1] / steps[m] for m in range(1, 16)}
        worst = max(ratios, key=ratios.get)
        print(f"  worst step M={worst} -> {worst + 1}: {ratios[worst]:.2f}x (target <= 1.15)")
        out[cfg] = {"ms_per_step": {m: round(v, 2) for m, v in steps.items()},
                    "worst_ratio": round(ratios[worst], 3), "worst_at": worst}
    if len(out) == 2:
        (a, ra), (b, rb) = out.items()
        out["speedup"] = {m: round(rb["ms_per_step"][m] / ra["ms_per_step"][m], 2) for m in MS}
        print(f"{b} / {a} per M: {out['speedup']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""GGUF weights kept in their blocks (`--quantization auto`) against today's dequantized
path (`none`), same build, same run, on the embedded SmolLM2 Q4_1: batch-1 decode (128
tokens after a 128-token prompt), a 512-token prefill, and 32 prompts of 128-512 tokens x 64
outputs at once; plus resident weight memory.

    python benchmarks/quantized_decode.py [--dtype float32,bfloat16]

The last line is a JSON object: per dtype, both paths' figures and auto / none.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RUN = r"""
import json, sys, time
sys.path.insert(0, %(here)r)
from offline_throughput import make_workload
from lane import LLM, SamplingParams
from lane.model_executor.loader import resident_weight_bytes
llm = LLM(%(model)r, dtype=%(dtype)r, quantization=%(q)r, show_progress=False, max_model_len=2048,
          kv_cache_memory_bytes=2 << 30, enable_prefix_caching=False)
greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
def timed(ids, n):
    t = time.perf_counter(); llm.generate({"prompt_token_ids": ids}, greedy(n), use_tqdm=False)
    return time.perf_counter() - t
p128, p512 = list(range(100, 228)), list(range(100, 612))
timed(p128, 4)
decode = 128 / (min(timed(p128, 129) for _ in range(2)) - min(timed(p128, 1) for _ in range(3)))
prefill = 512 / min(timed(p512, 1) for _ in range(2))
res = {"decode_tok_s": decode, "prefill_tok_s": prefill}
if %(batch)r:
    prompts = make_workload(32, 128, 512, 49152, 0)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(64), use_tqdm=False)
    res["batch32_out_tok_s"] = 32 * 64 / (time.perf_counter() - t)
res["weights_mib"] = resident_weight_bytes(llm.engine.worker.model) / 2**20
print(json.dumps(res))
"""


def lane_speed(dtype: str, quantization: str, model: str | None = None, batch: bool = True) -> dict:
    """lane's figures for one (dtype, quantization) in a fresh process (so neither path's
    compiled kernels or memory bias the other): decode_tok_s, prefill_tok_s, weights_mib,
    and with `batch` batch32_out_tok_s. `model`: a GGUF path (default: the embedded one)."""
    code = RUN % {"here": HERE, "model": model, "dtype": dtype, "q": quantization, "batch": batch}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "LANE_LOGGING_LEVEL": "WARNING"})
    if p.returncode:
        raise RuntimeError(f"lane {dtype} {quantization} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32,bfloat16")
    args = ap.parse_args()
    out = {}
    for dtype in args.dtype.split(","):
        res = {}
        for q in ("none", "auto"):
            try:
                res[q] = lane_speed(dtype, q)
            except RuntimeError as e:
                sys.exit(str(e))
            print(f"{dtype:8s} {q:4s}: " + ", ".join(f"{k} {v:.1f}" for k, v in res[q].items()), flush=True)
        ratios = {k: round(res["auto"][k] / res["none"][k], 2) for k in res["none"]}
        print(f"{dtype:8s} auto / none: {ratios}")
        out[dtype] = {"none": {k: round(v, 1) for k, v in res["none"].items()},
                      "auto": {k: round(v, 1) for k, v in res["auto"].items()}, "ratio": ratios}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

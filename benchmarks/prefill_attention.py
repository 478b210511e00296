"""Paged prefill attention: the kernel that reads the cache in place against the old
path (gather the request's blocks, repeat-interleave K/V for GQA, SDPA), same run.

(a) one layer's attention for one 512-token chunk (SmolLM2 shapes: 9 heads, 3 KV heads,
head_dim 64, 16-token blocks) at contexts 0 .. 7k, both paths side by side, and the
batch-invariant default (each row attended as a decode row): in bf16 on a CPU with AMX-BF16
its tiles (paged_attention_amx.cpp) and its AVX-512 kernel, against gather + SDPA;
(b) TTFT of the embedded SmolLM2 (``LLM()``, default chunking of 2048 tokens) at 512 / 2k
/ 7k-token prompts, each path in its own process (``LANE_PREFILL_ATTENTION=torch|kernel|rows``).

    python benchmarks/prefill_attention.py [--dtype float32] [--contexts 0,512,1024,2048,4096,7168]
        [--prompts 512,2048,7168]

The last line is a JSON object: per-chunk ms and TTFT s of both paths, and old / kernel.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

TTFT = r"""
import json, time
from lane import LLM, SamplingParams
llm = LLM(dtype=%(dtype)r, show_progress=False, max_model_len=8192, kv_cache_memory_bytes=1 << 30,
          enable_prefix_caching=False)
one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
def ttft(n):
    t = time.perf_counter(); llm.generate({"prompt_token_ids": list(range(100, 100 + n))}, one, use_tqdm=False)
    return time.perf_counter() - t
ttft(64)  # warm up
print(json.dumps({n: min(ttft(n) for _ in range(%(reps)d if n <= 2048 else 1)) for n in %(prompts)r}))
"""


def best(f, reps: int) -> float:
    f()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def per_chunk(dtype: torch.dtype, contexts: list[int], chunk: int = 512) -> dict:
    from lane.model_executor.layers import cpu_kernels
    from lane.model_executor.layers.attention import prefill_attention_torch

    assert cpu_kernels.build(), "the CPU kernels did not build"
    H, KVH, D, BS = 9, 3, 64, 16
    g = torch.Generator().manual_seed(0)
    res = {}
    tiles = dtype == torch.bfloat16 and cpu_kernels.attention_amx()
    for nc in contexts:
        total = nc + chunk
        nb = -(-total // BS)
        kc = torch.randn(nb + 8, KVH, BS, D, generator=g).to(dtype)
        vc = torch.randn(nb + 8, KVH, BS, D, generator=g).to(dtype)
        ids = torch.randperm(nb + 7, generator=g)[:nb] + 1  # a pool's blocks are not in order
        q = torch.randn(chunk, H, D, generator=g).to(dtype)
        flat = lambda c: c[ids].transpose(1, 2).reshape(-1, KVH, D)[nc:total]  # the chunk's own k/v
        k, v = flat(kc), flat(vc)
        reps = 5 if nc <= 2048 else 3
        old = best(lambda: prefill_attention_torch(q, k, v, kc, vc, ids, nc, D ** -0.5), reps)
        new = best(lambda: cpu_kernels.prefill_attention(q, kc, vc, ids, nc, D ** -0.5), reps)
        rows = {}  # the batch-invariant default: each row as a decode row (bf16: AMX tiles where present)
        for amx in ((True, False) if tiles else (False,)):
            if tiles:
                cpu_kernels.attention_amx(amx)
            rows["amx" if amx else "vector"] = best(
                lambda: cpu_kernels.prefill_rows_attention(q, kc, vc, ids, nc, D ** -0.5), reps)
        if tiles:
            cpu_kernels.attention_amx(True)
        res[nc] = {"torch_ms": old * 1e3, "kernel_ms": new * 1e3, "ratio": old / new,
                   **{f"rows_{k}_ms": t * 1e3 for k, t in rows.items()},
                   "sdpa_over_rows": old / min(rows.values())}
        print(f"chunk {chunk} at context {nc:5d}: gather+SDPA {old * 1e3:7.1f} ms  kernel {new * 1e3:7.1f} ms"
              f"  old/kernel {old / new:.2f}  rows: " + "  ".join(f"{k} {t * 1e3:.1f} ms" for k, t in rows.items())
              + f"  SDPA/rows {old / min(rows.values()):.2f}", flush=True)
    return res


def ttft(dtype: str, path: str, prompts: list[int]) -> dict:
    code = TTFT % {"dtype": dtype, "prompts": prompts, "reps": 2}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "LANE_PREFILL_ATTENTION": path})
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-2000:])
    return {int(k): v for k, v in json.loads(r.stdout.strip().splitlines()[-1]).items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--contexts", default="0,512,1024,2048,4096,7168")
    ap.add_argument("--prompts", default="512,2048,7168")
    a = ap.parse_args()
    contexts = [int(x) for x in a.contexts.split(",")]
    prompts = [int(x) for x in a.prompts.split(",")]
    print(f"(a) one layer, one 512-token chunk, {a.dtype}, {torch.get_num_threads()} threads", flush=True)
    chunks = per_chunk(getattr(torch, a.dtype), contexts)
    print(f"(b) TTFT, embedded SmolLM2, {a.dtype}", flush=True)
    t = {}
    for path in ("torch", "kernel", "rows"):  # rows: the batch-invariant default
        t[path] = ttft(a.dtype, path, prompts)
        print(f"  {path:6s}: " + "  ".join(f"{n} tokens {s:.2f} s" for n, s in t[path].items()), flush=True)
    print(json.dumps({"dtype": a.dtype, "chunk512": chunks,
                      "ttft_s": {n: {"torch": t["torch"][n], "kernel": t["kernel"][n], "rows": t["rows"][n],
                                     "ratio": t["torch"][n] / t["kernel"][n],
                                     "torch_over_rows": t["torch"][n] / t["rows"][n]} for n in prompts}}))


if __name__ == "__main__":
    main()

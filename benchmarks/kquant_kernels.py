"""The K-quant integer linear (Q4_K, Q5_K, Q6_K) against the Q4_1 kernel and fp32 F.linear on
one SmolLM2-like layer (N 576 outputs, K 1536 inputs: its down_proj), at M = 1, 4, 16 rows.
Per kind and M: microseconds a call (best of --repeat), GB/s over the weight bytes as
stored (the blocks; fp32: 4 bytes a weight) and rows / s (tok/s for this one layer).

    python benchmarks/kquant_kernels.py [--threads N] [--shape 576x1536]

The last line is a JSON object: {kind: {M: {us, gb_s, rows_s}}, "isa": ..., "threads": ...}.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from lane.model_executor.layers import cpu_kernels


def random_blocks(kind: str, N: int, K: int, rng: np.random.Generator) -> torch.Tensor:
    """Random bytes, with every fp16 scale (and min) set to a small positive value."""
    _, values, size = cpu_kernels.GGML_KINDS[kind]
    b = rng.integers(0, 256, (N * K // values, size), dtype=np.uint8)
    half = np.full((b.shape[0],), 1e-3, np.float16).view(np.uint8).reshape(-1, 2)
    for off in {"Q4_1": (0, 2), "Q6_K": (208,)}.get(kind, (0, 2)):
        b[:, off:off + 2] = half
    return torch.from_numpy(b.reshape(N, -1))


def best_us(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--shape", default="576x1536", help="N x K (K a multiple of 256)")
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    N, K = (int(v) for v in args.shape.split("x"))
    assert cpu_kernels.build(), "CPU kernels unavailable"
    rng = np.random.default_rng(0)
    w32 = torch.randn(N, K)
    out: dict = {}
    for kind in ("Q4_K", "Q5_K", "Q6_K", "Q4_1", "fp32"):
        blocks = None if kind == "fp32" else random_blocks(kind, N, K, rng)
        nbytes = N * K * 4 if blocks is None else blocks.numel()
        out[kind] = {}
        for M in (1, 4, 16):
            x = torch.randn(M, K)
            fn = (lambda: torch.nn.functional.linear(x, w32)) if blocks is None else (
                lambda: cpu_kernels.quant_linear(x, blocks, kind, N))
            us = best_us(fn, args.repeat)
            out[kind][M] = {"us": round(us, 1), "gb_s": round(nbytes / us / 1e3, 1), "rows_s": round(M / us * 1e6)}
            print(f"{kind:5s} M={M:2d}: {us:8.1f} us  {nbytes / us / 1e3:6.1f} GB/s  {M / us * 1e6:10.0f} rows/s",
                  flush=True)
    out.update(isa=cpu_kernels.isa(), threads=torch.get_num_threads(), shape=[N, K])
    print(json.dumps(out))


if __name__ == "__main__":
    main()

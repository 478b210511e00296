"""lane's AMX tiles, on the same rows in one run, one thread, one linear layer on SmolLM2's shapes
(576 -> 1536 and 1536 -> 576; 768 for the K-quants) by row count:
- x8 (AMX-INT8): the int8 tiles against the VNNI pair kernel, per kind (the tiles give the pair
  kernel's outputs bit for bit, so the switch is a matter of speed only; the kernels take AMX
  from `lane_x8_amx`'s threshold);
- bf16 (AMX-BF16): the dense bf16 tiles (every M under `--quantization none` in bf16) against
  lane's FMA kernel (what the tiles replace) and torch's F.linear (oneDNN's bf16 AMX GEMM, the
  peer: vLLM's CPU build runs it, shape-dependent and so not batch-invariant);
- x8bf16 (AMX-BF16): bf16 rows on x8 Q4_0 / Q4_1 blocks as the default runs them, on bf16 tiles
  after dequantizing each unit of weight rows, against the int8 kernels that ran them before
  (pair kernel, int8 tiles from their threshold) and the dense tiles on the weight already in
  bf16 (`--quantization none`: what the dequantization costs).

    python benchmarks/amx_tiles.py [--sections x8,bf16,x8bf16] [--kinds Q4_0,Q4_1,Q8_0,Q4_K,Q5_K]
                                   [--rows 1,8,16,32,64,128,512]

Needs a CPU with AMX (Sapphire Rapids or later). The last line is a JSON object: per section,
shape and row count, the other kernel's time / the tiles' (> 1: the tiles are faster).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


def best_us(fn, reps: int = 20, rounds: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e6


def bf16_section(rows: str, g: torch.Generator, out: dict) -> None:
    import torch.nn.functional as F

    from lane.model_executor.layers import cpu_kernels
    try:
        for N, K in ((1536, 576), (576, 1536)):
            w = torch.randn(N, K, generator=g).to(torch.bfloat16)
            cells = []
            for M in map(int, rows.split(",")):
                x = torch.randn(M, K, generator=g).to(torch.bfloat16)
                run = lambda: cpu_kernels.small_m_linear(x, w, None)  # noqa: E731
                cpu_kernels.bf16_amx(True)
                tiles = best_us(run)
                cpu_kernels.bf16_amx(False)
                fma = best_us(run)
                onednn = best_us(lambda: F.linear(x, w))
                out[f"bf16 {K}->{N} M={M} fma/tiles"] = round(fma / tiles, 2)
                out[f"bf16 {K}->{N} M={M} onednn/tiles"] = round(onednn / tiles, 2)
                cells.append(f"M={M} {tiles:5.0f} us (FMA {fma / tiles:5.2f}x, oneDNN {onednn / tiles:4.2f}x)")
            print(f"bf16  {K:4d}->{N:4d}  tiles: " + "  ".join(cells), flush=True)
    finally:
        cpu_kernels.bf16_amx(True)


def x8bf16_section(rows: str, g: torch.Generator, out: dict) -> None:
    from test_quant_linear import random_blocks

    from lane.model_executor.layers import cpu_kernels
    for kind in ("Q4_0", "Q4_1"):
        for N, K in ((1536, 576), (576, 1536)):
            packed = cpu_kernels.repack_x8(random_blocks(kind, N, K, g), kind, N)
            w = cpu_kernels.dequant_x8(packed, kind, N, K, torch.bfloat16)
            cells = []
            for M in map(int, rows.split(",")):
                x = torch.randn(M, K, generator=g).to(torch.bfloat16)
                tiles = best_us(lambda: cpu_kernels.quant_linear(x, packed, kind, N, x8=True))
                int8 = best_us(lambda: cpu_kernels.quant_linear(x, packed, kind, N, x8=True, int8=True))
                dense = best_us(lambda: cpu_kernels.small_m_linear(x, w, None))
                out[f"x8bf16 {kind} {K}->{N} M={M} int8/tiles"] = round(int8 / tiles, 2)
                out[f"x8bf16 {kind} {K}->{N} M={M} dense/tiles"] = round(dense / tiles, 2)
                cells.append(f"M={M} {tiles:5.0f} us (int8 {int8 / tiles:4.2f}x, dense {dense / tiles:4.2f}x)")
            print(f"{kind:5s} {K:4d}->{N:4d}  bf16 tiles: " + "  ".join(cells), flush=True)


def main() -> None:
    from test_kquant import random_blocks as kquant_blocks
    from test_quant_linear import random_blocks

    from lane.model_executor.layers import cpu_kernels

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default="x8,bf16,x8bf16")
    ap.add_argument("--kinds", default="Q4_0,Q4_1,Q8_0,Q4_K,Q5_K")  # (Q6_K stays on the pair kernel)
    ap.add_argument("--rows", default="1,8,16,32,64,128,512")
    args = ap.parse_args()
    assert cpu_kernels.build(), "the CPU kernels did not build"
    sections = args.sections.split(",")
    usable, threshold = cpu_kernels.x8_amx()
    if not usable and not cpu_kernels.bf16_amx():
        sys.exit("no AMX here (or LANE_CPU_AMX=0): nothing to compare")
    torch.set_num_threads(1)
    g, rng = torch.Generator().manual_seed(0), np.random.default_rng(0)
    out: dict = {"amx_min_rows": threshold}
    if "bf16" in sections and cpu_kernels.bf16_amx():
        bf16_section(args.rows, g, out)
    if "x8bf16" in sections and cpu_kernels.x8_bf16_amx():
        x8bf16_section(args.rows, g, out)
    if "x8" not in sections or not usable:
        print(json.dumps(out))
        return
    try:
        for kind in args.kinds.split(","):
            # SmolLM2's widths; 768 for the K-quants, whose rows are whole super-blocks of 256
            width = 768 if kind in cpu_kernels.K_KINDS else 576
            for N, K in ((1536, width), (width, 1536)):
                blocks = torch.from_numpy(kquant_blocks(kind, N, K, rng)) if kind in cpu_kernels.K_KINDS else \
                    random_blocks(kind, N, K, g)
                packed = cpu_kernels.repack_x8(blocks, kind, N)
                cells = []
                for M in map(int, args.rows.split(",")):
                    x = torch.randn(M, K, generator=g).to(torch.bfloat16)
                    # (int8: bf16 rows too, not the dequantizing bf16 tiles)
                    run = lambda: cpu_kernels.quant_linear(x, packed, kind, N, x8=True, int8=True)  # noqa: E731
                    cpu_kernels.x8_amx(True, 1)
                    tiles = best_us(run)
                    cpu_kernels.x8_amx(False)
                    pairs = best_us(run)
                    out[f"{kind} {K}->{N} M={M}"] = round(pairs / tiles, 2)
                    cells.append(f"M={M} {pairs:6.0f}/{tiles:6.0f} us ({pairs / tiles:4.2f}x)")
                print(f"{kind:5s} {K:4d}->{N:4d}  pair/tiles: " + "  ".join(cells), flush=True)
    finally:
        cpu_kernels.x8_amx(True, threshold)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Paged decode attention over a cache too big for the L3: B decode rows (SmolLM2's shapes: 9
heads, 3 KV heads, head_dim 64, 16-token blocks, bf16) at context L over each of 30 layers'
caches, laid out as lane's KV pool is (a K and a V tensor a layer, a request's block table the
same in every layer, its blocks anywhere in the pool), as a 64-stream decode step reads them. Each
kernel's time for all 30 layers and its achieved GB/s over the K/V bytes, against the machine's
DRAM read bandwidth measured in the same run (a 1 GiB sum, `dram_bound.dram_read_gbs`), and
against torch's way (gather the blocks, repeat K/V for GQA, SDPA), which a serving engine
without a paged kernel runs:
- tiles: the AMX-BF16 kernel (`paged_attention_amx.cpp`, where the CPU has AMX-BF16),
- dpbf16: the AVX512-BF16 vector kernel (`paged_attention.cpp`, where the CPU has AVX512-BF16:
  what runs there without AMX, or with `LANE_CPU_AMX=0`),
- avx512: the fp32 vector kernel (`paged_attention.cpp`: every other CPU),
- int8, fp8_e4m3: the same rows over C8's 8-bit caches (`--kv-cache-dtype`: half the bytes, and a
  float scale per token and KV head), on whichever kernel this CPU takes for each (the AMX tiles;
  int8: the integer VNNI kernel, fp8: the AVX512-BF16 one; else the float one), against the
  fastest bf16 kernel,
- torch: gather + `F.scaled_dot_product_attention`, one request at a time.

    python benchmarks/decode_attention.py [--rows 64] [--context 450] [--pool-gib 4]

The last line is a JSON object: ms per 30 layers and GB/s of each, DRAM GB/s, and the
kernels' share of it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LAYERS, H, KVH, D, BS = 30, 9, 3, 64, 16


def best_ms(fn, rounds: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--context", type=int, default=450)
    ap.add_argument("--pool-gib", type=float, default=4.0, help="K + V pool size (blocks drawn at random from it)")
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = ap.parse_args()
    from dram_bound import dram_read_gbs

    from lane.model_executor.layers import cpu_kernels
    if not cpu_kernels.build():
        sys.exit("the CPU kernels did not build")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    B, L = args.rows, args.context
    per = (L + BS - 1) // BS
    nb = int(args.pool_gib * (1 << 30) / (2 * LAYERS * KVH * BS * D * 2))  # blocks a layer's tensors hold
    if nb < B * per:
        sys.exit(f"--pool-gib {args.pool_gib} holds {nb} blocks, fewer than the {B * per} the rows need")
    print(f"pool: {LAYERS} layers x 2 x {nb} blocks ({args.pool_gib:.1f} GiB); {B} rows x {L} keys", flush=True)
    caches = []
    for _ in range(LAYERS):
        kv = []
        for _ in range(2):  # written in slices: no float32 copy of the pool
            t = torch.empty(nb, KVH, BS, D, dtype=torch.bfloat16)
            for s in range(0, nb, 4096):
                t[s:s + 4096] = torch.randn(min(4096, nb - s), KVH, BS, D, generator=g)
            kv.append(t)
        caches.append(kv)
    tables = torch.randperm(nb, generator=g)[:B * per].view(B, per).contiguous()  # every layer's
    qs = [torch.randn(B, H, D, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
    lens = torch.full((B,), L, dtype=torch.int32)
    scale = D ** -0.5

    def kernel():
        for q, (kc, vc) in zip(qs, caches):
            cpu_kernels.decode_attention(q, kc, vc, tables, lens, scale)

    def torch_way():
        import torch.nn.functional as F
        for q, (kc, vc) in zip(qs, caches):
            for b in range(B):
                k = kc[tables[b]].permute(1, 0, 2, 3).reshape(KVH, -1, D)[:, :L].repeat_interleave(H // KVH, 0)
                v = vc[tables[b]].permute(1, 0, 2, 3).reshape(KVH, -1, D)[:, :L].repeat_interleave(H // KVH, 0)
                F.scaled_dot_product_attention(q[b][:, None], k, v, scale=scale)

    gbytes = LAYERS * B * L * KVH * D * 2 * 2 / 1e9
    res: dict = {"rows": B, "context": L, "gbytes": round(gbytes, 3)}
    dram = dram_read_gbs(args.threads)
    res["dram_gbs"] = round(dram, 1)
    print(f"DRAM read: {dram:.1f} GB/s ({args.threads} threads)", flush=True)
    kinds = []
    if cpu_kernels.attention_amx():
        kinds.append("tiles")
    if cpu_kernels.attention_dpbf16():
        kinds.append("dpbf16")
    kinds.append("avx512" if cpu_kernels.isa() == "avx512" else cpu_kernels.isa())
    try:
        for kind in kinds:
            cpu_kernels.attention_amx(kind == "tiles")
            cpu_kernels.attention_dpbf16(kind == "dpbf16")
            ms = best_ms(kernel)
            res[f"{kind}_ms"], res[f"{kind}_gbs"] = round(ms, 1), round(gbytes / ms * 1e3, 1)
            res[f"{kind}_of_dram"] = round(gbytes / ms * 1e3 / dram, 2)
            print(f"{kind:>7}: {ms:7.1f} ms for {LAYERS} layers, {gbytes / ms * 1e3:5.1f} GB/s "
                  f"({res[f'{kind}_of_dram']:.0%} of DRAM)", flush=True)
    finally:
        cpu_kernels.attention_amx(True)
        cpu_kernels.attention_dpbf16(True)
    # C8: the same blocks as 8-bit pools (each (token, head) row quantized with its own scale)
    c8_gbytes = LAYERS * B * L * KVH * (D + 4) * 2 / 1e9  # the bytes and scales read
    bf16_best = min(res[f"{k}_ms"] for k in kinds)
    for kind, top in (("int8", 127.0), ("fp8_e4m3", 448.0)):
        c8 = []
        for kc, vc in caches:
            kv8 = []
            for t in (kc, vc):
                q8, s8 = torch.empty(t.shape, dtype=torch.int8 if kind == "int8" else torch.uint8), torch.empty(t.shape[:3])
                for s in range(0, nb, 4096):  # in slices, as the pool was written
                    x = t[s:s + 4096].float()
                    s8[s:s + 4096] = x.abs().amax(-1) / top
                    x = x / s8[s:s + 4096].clamp_min(1e-30)[..., None]
                    q8[s:s + 4096] = x.round().to(torch.int8) if kind == "int8" else x.to(torch.float8_e4m3fn).view(torch.uint8)
                kv8 += [q8, s8]
            c8.append(kv8)

        def c8_kernel():
            for q, (kc, ks, vc, vs) in zip(qs, c8):
                cpu_kernels.decode_attention_8bit(q, kc, vc, ks, vs, tables, lens, scale, kind != "int8")

        ms = best_ms(c8_kernel)
        res.update({f"{kind}_ms": round(ms, 1), f"{kind}_gbs": round(c8_gbytes / ms * 1e3, 1),
                    f"{kind}_of_dram": round(c8_gbytes / ms * 1e3 / dram, 2), f"{kind}_vs_bf16": round(bf16_best / ms, 2)})
        print(f"{kind:>7}: {ms:7.1f} ms for {LAYERS} layers, {c8_gbytes / ms * 1e3:5.1f} GB/s "
              f"({res[f'{kind}_of_dram']:.0%} of DRAM), {bf16_best / ms:.2f}x the fastest bf16 kernel", flush=True)
        c8 = None
    ms = best_ms(torch_way, rounds=2)
    res["torch_ms"] = round(ms, 1)
    print(f"  torch: {ms:7.1f} ms for {LAYERS} layers (gather + SDPA); kernels: "
          + ", ".join(f"{k} {ms / res[f'{k}_ms']:.1f}x" for k in kinds), flush=True)
    for k in kinds:
        res[f"torch_over_{k}"] = round(ms / res[f"{k}_ms"], 2)
    print(json.dumps(res))


if __name__ == "__main__":
    main()

"""The int8 linear kernels (W8A16, W8A8) against torch's fp32 and bf16 F.linear, on
SmolLM2-like shapes (N x K = 576x1536, 1536x576, 576x576) for M = 1 .. 512 rows: the best
of several timed repeats, in ms, and GB/s over the int8 weight bytes (N * K).

    python benchmarks/int8_kernels.py [--m 1,2,4,8,16,32,512] [--threads T] [--dtype float32] [--cpu-time]

--cpu-time (one thread) times this thread's CPU time, not the wall clock: on a machine shared
with other work a descheduled thread would otherwise count as kernel time.

The last line is a JSON object: {"N x K": {"M": {path: ms}}}.
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from lane.model_executor.layers import cpu_kernels as ck

SHAPES = ((576, 1536), (1536, 576), (576, 576))  # N, K: down_proj-, gate/up-, o_proj-like


CLOCK = time.perf_counter


def best_ms(fn, budget_s: float = 0.3, min_reps: int = 10) -> float:
    fn()
    best, reps, t_end = float("inf"), 0, time.perf_counter() + budget_s
    while reps < min_reps or time.perf_counter() < t_end:
        t = CLOCK()
        fn()
        best = min(best, CLOCK() - t)
        reps += 1
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,2,4,8,16,32,512")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="float32", help="the activations' dtype for the int8 kernels")
    ap.add_argument("--cpu-time", action="store_true", help="time this thread's CPU time (needs --threads 1)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time:
        assert torch.get_num_threads() == 1, "--cpu-time needs --threads 1 (the kernels then run on this thread)"
        global CLOCK
        CLOCK = time.thread_time
    assert ck.build(), "the CPU kernels did not build"
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    out = {}
    print(f"isa {ck.isa()}, threads {torch.get_num_threads()}, x {args.dtype}, {'cpu' if args.cpu_time else 'wall'} "
          "time; best ms (GB/s of int8 weights)")
    for N, K in SHAPES:
        w = torch.randn(N, K, generator=g) * 0.02
        qw, sw = ck.quantize_weight_int8(w)
        wsum = ck.int8_weight_sums(qw)
        wb = w.bfloat16()
        res = out[f"{N}x{K}"] = {}
        for M in (int(m) for m in args.m.split(",")):
            x = torch.randn(M, K, generator=g)
            xd, xb = x.to(dtype), x.bfloat16()
            r = res[M] = {
                "w8a16": best_ms(lambda: ck.int8_linear_w8a16(xd, qw, sw)),
                "w8a8": best_ms(lambda: ck.int8_linear_w8a8(xd, qw, sw, wsum=wsum)),
                "fp32": best_ms(lambda: F.linear(x, w)),
                "bf16": best_ms(lambda: F.linear(xb, wb)),
            }
            print(f"{N}x{K} M={M:<4}" + "".join(f"  {k} {v:7.3f} ({N * K / v / 1e6:5.1f})" for k, v in r.items()),
                  flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""Offline throughput: lane against HF transformers `generate`, same workload, one run.

Workload: N requests with random prompts of 128-512 tokens, 128 output tokens each,
ignore_eos, greedy, the CPU's fastest dtype (``--dtype auto``: bfloat16 with AVX512-BF16,
else float32), on the embedded SmolLM2-135M. HF runs at batch sizes
8/16/32/64 (prompts sorted by length, left-padded per batch); the ratio is lane's
output tokens/s over HF's best. Also: lane's batch-1 decode and 1,024-token prefill
speed. Every peer figure it prints is measured in this run (HF transformers).

    python benchmarks/offline_throughput.py [--num-prompts 64] [--hf-batch-sizes 8,16,32,64]

The last line is a JSON object of the headline figures.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch


def cpu_busy_fraction(seconds: float = 1.0) -> float:
    """Share of all CPUs busy over the next ``seconds`` (from /proc/stat)."""
    def sample():
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        return sum(vals), vals[3] + vals[4]  # total, idle + iowait

    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except OSError:
        return 0.0
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


DTYPES = ["auto", "bfloat16", "float32", "float16"]


def concrete_dtype(name: str) -> str:
    """'auto' -> this CPU's fastest dtype, as lane picks it (bfloat16 with AVX512-BF16 / AMX,
    else float32), so every peer in the run gets the same one."""
    import torch

    from lane import platform

    return str(platform.resolve_dtype(name, torch.device("cpu"))).removeprefix("torch.")


def check_quiet() -> None:
    busy = cpu_busy_fraction()
    if busy > 0.15:
        print(f"warning: {busy:.0%} of the CPUs are busy with other work; figures will be noisy "
              f"(ratios measured in this run still compare like with like)", file=sys.stderr)


def make_workload(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_lane(prompts, out_len: int, dtype: str, threads: int | None, quantization: str = "none") -> dict:
    from lane import LLM, SamplingParams

    llm = LLM(dtype=dtype, threads=threads, max_model_len=2048, enable_prefix_caching=False,
              kv_cache_memory_bytes=2 << 30, quantization=quantization)
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], SamplingParams(max_tokens=4),
                 use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    dt = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    res = {"lane_tok_s": n_out / dt, "lane_total_tok_s": (n_out + sum(map(len, prompts))) / dt,
           "lane_s": dt}
    # batch-1 decode: 128-token prompt; time(1 + 128 tokens) - time(1 token) = 128 decode steps
    rng = random.Random(1)
    p128 = [rng.randrange(100, 49152) for _ in range(128)]
    p1024 = [rng.randrange(100, 49152) for _ in range(1024)]

    def timed(ids, n):
        t = time.perf_counter()
        llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=n,
                                                               ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t

    timed(p128, 8)
    t1 = min(timed(p128, 1) for _ in range(3))
    t129 = min(timed(p128, 129) for _ in range(2))
    res["lane_b1_decode_tok_s"] = 128 / (t129 - t1)
    res["lane_prefill_tok_s"] = 1024 / min(timed(p1024, 1) for _ in range(3))
    return res


def run_hf(prompts, out_len: int, dtype: torch.dtype, batch_sizes: list[int]) -> dict:
    from transformers import AutoModelForCausalLM

    from lane.config import default_model_path

    d, f = os.path.split(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=dtype).eval()
    order = sorted(prompts, key=len)
    pad = 0
    results = {}
    for bsz in batch_sizes:
        t0 = time.perf_counter()
        n_out = 0
        for i in range(0, len(order), bsz):
            batch = order[i:i + bsz]
            width = max(map(len, batch))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            with torch.inference_mode():
                out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=out_len,
                                     min_new_tokens=out_len, do_sample=False, pad_token_id=pad)
            n_out += (out.shape[1] - width) * len(batch)
        dt = time.perf_counter() - t0
        results[bsz] = n_out / dt
        print(f"  HF batch {bsz:3d}: {results[bsz]:8.1f} output tok/s ({dt:.1f} s)", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-input-len", type=int, default=128)
    ap.add_argument("--max-input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: the CPU's fastest")
    ap.add_argument("--hf-batch-sizes", default="8,16,32,64")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quantization", default="none", choices=["auto", "none"],
                    help="auto: lane keeps the GGUF's Q4_1 blocks (HF always runs dequantized weights)")
    args = ap.parse_args()
    args.dtype = concrete_dtype(args.dtype)
    check_quiet()
    prompts = make_workload(args.num_prompts, args.min_input_len, args.max_input_len, 49152, args.seed)
    print(f"workload: {len(prompts)} requests, {args.min_input_len}-{args.max_input_len} prompt "
          f"tokens (total {sum(map(len, prompts))}), {args.output_len} output tokens, {args.dtype}")
    print("lane ...", flush=True)
    lane = run_lane(prompts, args.output_len, args.dtype, args.threads, args.quantization)
    print(f"  lane: {lane['lane_tok_s']:.1f} output tok/s ({lane['lane_s']:.1f} s)")
    print("HF transformers generate ...", flush=True)
    hf = run_hf(prompts, args.output_len, getattr(torch, args.dtype),
                [int(b) for b in args.hf_batch_sizes.split(",")])
    best = max(hf, key=hf.get)
    ratio = lane["lane_tok_s"] / hf[best]
    print(f"\nlane {lane['lane_tok_s']:.1f} vs HF best (batch {best}) {hf[best]:.1f} output tok/s: "
          f"ratio {ratio:.2f}")
    print(f"lane batch-1 decode: {lane['lane_b1_decode_tok_s']:.1f} tok/s; prefill (1,024 tokens): "
          f"{lane['lane_prefill_tok_s']:.0f} tok/s")
    print(json.dumps({"lane_tok_s": round(lane["lane_tok_s"], 1), "hf_tok_s": round(hf[best], 1),
                      "hf_best_batch": best, "ratio": round(ratio, 2),
                      "lane_b1_decode_tok_s": round(lane["lane_b1_decode_tok_s"], 1),
                      "lane_prefill_tok_s": round(lane["lane_prefill_tok_s"], 1),
                      "dtype": args.dtype, "quantization": args.quantization, "num_prompts": len(prompts),
                      "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()

"""MoE decode: a small-but-not-trivial DeepSeek V3.2 (MLA + DSA indexer + routed
experts) decoding in lane and in HF transformers, same run, same weights, same dtype.

The model is random (written once by ``lane tiny-model`` machinery under
~/.cache/lane/bench-moe-v32): 8 layers (1 dense), hidden 512, 32 routed experts
(8 active, 4 groups of which 2 are kept) + 1 shared, q LoRA 256, kv LoRA 128,
indexer 8 heads x 64 with index_topk 128. Prompts are longer than index_topk, so
the sparse path selects. Decode speed is measured as (time for 1 + N tokens) -
(time for 1 token): prefill cancels out. Both sides run greedy, equal-length
prompts (no padding), ignore EOS.

    python benchmarks/moe_decode.py [--batch-sizes 1,8] [--prompt-len 256] [--new-tokens 64]

The last line is a JSON object of the headline figures.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_throughput import DTYPES, check_quiet, concrete_dtype  # noqa: E402

CONFIG = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=8,
              first_k_dense_replace=1, n_routed_experts=32, num_experts_per_tok=8, n_group=4, topk_group=2,
              n_shared_experts=1, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=256,
              kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
              index_n_heads=8, index_head_dim=64, index_topk=128, initializer_range=0.05)
MODEL_DIR = os.path.expanduser(os.path.join("~", ".cache", "lane", "bench-moe-v32"))


def cached_model(arch: str, out_dir: str, config: dict) -> str:
    """The benchmark's random checkpoint, written once."""
    if not os.path.exists(os.path.join(out_dir, "model.safetensors")):
        from lane.entrypoints.tiny_model import write_tiny_model

        print(f"writing the benchmark model to {out_dir} ...", flush=True)
        write_tiny_model(arch, out_dir, seed=0, **config)
    return out_dir


def prompts(batch: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return torch.randint(100, 49152, (batch, length), generator=g).tolist()


def time_lane(llm, ids, n) -> float:
    from lane import SamplingParams

    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in ids],
                 SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t0


@torch.inference_mode()
def time_hf(model, ids, n) -> float:
    x = torch.tensor(ids)
    t0 = time.perf_counter()
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    assert out.shape[1] == x.shape[1] + n
    return time.perf_counter() - t0


def decode_tok_s(timer, model, ids, n_new: int, repeats: int) -> float:
    timer(model, ids, 2)  # warm-up
    best = float("inf")
    for _ in range(repeats):  # best of: the machine is shared and noisy
        best = min(best, timer(model, ids, 1 + n_new) - timer(model, ids, 1))
    return len(ids) * n_new / best


def compare(d: str, label: str, args, lane_kwargs: dict | None = None) -> dict:
    """lane vs transformers decode tok/s on the model in ``d`` at each batch size, one run;
    returns the headline JSON object."""
    from transformers import AutoModelForCausalLM

    from lane import LLM

    print("loading lane and transformers ...", flush=True)
    llm = LLM(d, dtype=args.dtype, kv_cache_memory_bytes=256 << 20, show_progress=False,
              enable_prefix_caching=False, **(lane_kwargs or {}))
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=getattr(torch, args.dtype)).eval()
    head = {"model": label, "dtype": args.dtype, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        ids = prompts(b, args.prompt_len)
        lane_tps = decode_tok_s(time_lane, llm, ids, args.new_tokens, args.repeats)
        print(f"batch {b}: lane {lane_tps:8.1f} decode tok/s", flush=True)
        hf_tps = decode_tok_s(time_hf, hf, ids, args.new_tokens, args.repeats)
        print(f"batch {b}: HF   {hf_tps:8.1f} decode tok/s   ratio {lane_tps / hf_tps:.2f}", flush=True)
        head.update({f"lane_tok_s_b{b}": round(lane_tps, 1), f"hf_tok_s_b{b}": round(hf_tps, 1),
                     f"ratio_b{b}": round(lane_tps / hf_tps, 2)})
    return head


def arguments(doc: str, dtype: str = "auto") -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default=dtype, choices=DTYPES, help="auto: the CPU's fastest")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    args.dtype = concrete_dtype(args.dtype)
    return args


def main() -> None:
    args = arguments(__doc__)
    check_quiet()
    print(json.dumps(compare(cached_model("deepseek_v32", MODEL_DIR, CONFIG), "deepseek_v32 random, 8 layers, 32 experts (8 active), hidden 512", args)))


if __name__ == "__main__":
    main()

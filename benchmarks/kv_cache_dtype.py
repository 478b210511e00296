"""C8, the 8-bit KV cache, against the model-dtype cache, in one run on the embedded SmolLM2:

- speed: decode tok/s of one request at a long context (default 4k tokens) with
  ``--kv-cache-dtype auto`` / ``int8`` / ``fp8_e4m3`` (the default dtype and weights:
  what ``lane serve`` runs), and the KV bytes that context occupies;
- quality: perplexity on this README (float32 weights, ``--quantization none``), and greedy
  agreement over 256 tokens from a few prompts, against ``auto``;
- capacity: bytes per token and tokens per GiB, as ``lane explain`` counts them, here and for
  the full-size DeepSeek V3, V3.2 and V4-Flash configs (transformers' defaults), bf16 against
  8 bits, with what a million tokens of context keep.

Decode figures are (time for 1 + N tokens) - (time for 1 token), the context a prefix-cache hit
(cached by a warm-up run), so the prefill (its last block only) cancels out.

    python benchmarks/kv_cache_dtype.py [--context 4096] [--new-tokens 32] [--tokens 256]

The last line is a JSON object of the headline figures.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from quantized_quality import PROMPTS  # noqa: E402

KINDS = ("auto", "int8", "fp8_e4m3")
FULL_SIZE = {"DeepSeek V3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
             "DeepSeek V3.2": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
             "DeepSeek V4-Flash": ("DeepseekV4Config", "DeepseekV4ForCausalLM")}


def explain_bytes_per_token(model: str, dtype: str, kind: str) -> float:
    """Bytes per token kept for the whole context (prefix caching on), as lane explain counts
    them for a model directory (its config only: a weightless model)."""
    import re

    from lane.entrypoints.explain import explain

    text = explain(model, dtype, kv_cache_dtype=kind)
    return float(re.search(r"per token, all \d+ layers: ([\d,.]+) B", text).group(1).replace(",", ""))


def config_bytes_per_token(config: dict, kind: str) -> float:
    """The same for a config (a dict with ``architectures``), in bf16."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)
        return explain_bytes_per_token(d, "bfloat16", kind)


def full_size_bytes() -> dict:
    """Bytes per token kept for the whole context (prefix caching on) of the full-size configs,
    bf16 and C8, from lane explain on a weightless model."""
    import transformers

    out = {}
    for name, (cls, arch) in FULL_SIZE.items():
        cfg = {**getattr(transformers, cls)().to_dict(), "architectures": [arch]}
        out[name] = {"bf16" if kind == "auto" else kind: config_bytes_per_token(cfg, kind) for kind in ("auto", "int8")}
    return out


def decode_speed(kind: str, ids: list[int], new: int, repeats: int) -> dict:
    from lane import LLM, SamplingParams

    llm = LLM(kv_cache_dtype=kind, show_progress=False, max_model_len=len(ids) + new + 16,
              max_num_batched_tokens=2048)
    try:
        def run(n: int) -> float:
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                         use_tqdm=False)
            return time.perf_counter() - t0

        run(2)  # warm-up: the context goes into the prefix cache
        best = min(run(1 + new) - run(1) for _ in range(repeats))
        page = llm.engine.kv_cache_config.groups[0].page_size_bytes
        return dict(tok_s=new / best, ms_per_token=best * 1e3 / new,
                    bytes_per_token=page // llm.engine.kv_cache_config.groups[0].block_size,
                    dtype=str(llm.config.model_config.dtype).removeprefix("torch."))
    finally:
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=256, help="greedy tokens compared per prompt")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    from lane import LLM, SamplingParams
    from lane.bench.quality import perplexity

    readme = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
    res: dict = {"context": args.context}
    speed = {}
    text = open(readme).read()
    for kind in KINDS:
        print(f"[decode at {args.context} tokens of context] --kv-cache-dtype {kind} ...", flush=True)
        if not speed:
            from lane.config import ModelConfig

            tok = ModelConfig(None).get_tokenizer()
            ids = (tok.encode(text) * (1 + args.context // 1000))[:args.context]
        speed[kind] = decode_speed(kind, ids, args.new_tokens, args.repeats)
        s = speed[kind]
        print(f"  {s['tok_s']:6.1f} tok/s ({s['ms_per_token']:.1f} ms a token; {s['dtype']} model), "
              f"{s['bytes_per_token']:,} B of KV per token: {s['bytes_per_token'] * args.context / 2**20:.1f} MiB "
              f"for this context; {2**30 // s['bytes_per_token']:,} tokens per GiB", flush=True)
    for kind in KINDS[1:]:
        r = speed[kind]["tok_s"] / speed["auto"]["tok_s"]
        print(f"  {kind}: {r:.2f}x auto's decode speed, {speed['auto']['bytes_per_token'] / speed[kind]['bytes_per_token']:.2f}x "
              f"its tokens per GiB")
    res["decode"] = {k: {kk: round(vv, 2) if isinstance(vv, float) else vv for kk, vv in v.items()}
                     for k, v in speed.items()}
    res["decode_ratio_vs_auto"] = {k: round(speed[k]["tok_s"] / speed["auto"]["tok_s"], 3) for k in KINDS[1:]}
    common = dict(dtype="float32", quantization="none", show_progress=False, max_model_len=2048,
                  kv_cache_memory_bytes=512 << 20, enable_prefix_caching=False)
    ppl, outs = {}, {}
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    for kind in KINDS:
        llm = LLM(kv_cache_dtype=kind, **common)
        ids = llm.get_tokenizer().encode(text)[:1024]
        ppl[kind] = perplexity(llm, ids)
        outs[kind] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        llm.shutdown()
        print(f"perplexity, README ({len(ids)} tokens, float32 weights), --kv-cache-dtype {kind}: {ppl[kind]:.4f} "
              f"({ppl[kind] / ppl['auto']:.4f}x auto)", flush=True)
    agree = {}
    for kind in KINDS[1:]:
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                  for a, b in zip(outs[kind], outs["auto"])]
        same = [sum(x == y for x, y in zip(a, b)) / len(a) for a, b in zip(outs[kind], outs["auto"])]
        agree[kind] = dict(identical_prefix=prefix, identical_prefix_mean=round(sum(prefix) / len(prefix), 1),
                           same_by_position=round(sum(same) / len(same), 3))
        print(f"  {kind}: greedy identical to auto's for {agree[kind]['identical_prefix']} of {args.tokens} tokens; "
              f"{100 * agree[kind]['same_by_position']:.1f}% by position")
    res["perplexity"] = {k: round(v, 4) for k, v in ppl.items()}
    res["perplexity_ratio_vs_auto"] = {k: round(ppl[k] / ppl["auto"], 4) for k in KINDS[1:]}
    res["greedy_agreement"] = agree
    print("full-size configs (transformers' defaults), KV bytes per token kept for the whole context:")
    sizes = full_size_bytes()
    for name, b in sizes.items():
        print(f"  {name:18s} bf16 {b['bf16']:9,.0f} B ({b['bf16'] * 2**20 / 2**30:6.2f} GiB per 1M tokens); "
              f"int8 {b['int8']:9,.0f} B ({b['int8'] * 2**20 / 2**30:6.2f} GiB): {b['bf16'] / b['int8']:.2f}x")
    res["full_size_bytes_per_token"] = sizes
    print(json.dumps(res))


if __name__ == "__main__":
    main()

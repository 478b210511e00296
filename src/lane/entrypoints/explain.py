"""``lane explain MODEL``: the seed's two troubleshooting layers for a model directory or
GGUF file: (1) which implementation the registry resolves its architecture to, and who
registered it; (2) which attention backend its config selects, on which fields, and the
KV cache layout that follows (bytes per token per layer, blocks that fit the budget)."""
from __future__ import annotations

from dataclasses import dataclass

from lane import platform, plugins
from lane.registry import ModelRegistry

BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class CacheLayout:
    what: str  # what one token of one layer keeps
    bytes_per_token_layer: int
    full_kv_bytes_per_token_layer: int  # what plain K and V for every head would take
    num_layers: int


def cache_layout(cfg, backend: str, dtype_bytes: int) -> CacheLayout:
    layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    if backend in ("mla", "sparse_mla"):
        latent, rope = int(cfg.kv_lora_rank), int(getattr(cfg, "qk_rope_head_dim", 0) or 0)
        nope, v = int(getattr(cfg, "qk_nope_head_dim", 0) or 0), int(getattr(cfg, "v_head_dim", 0) or 0)
        per = (latent + rope) * dtype_bytes
        what = f"latent {latent} + rope key {rope}"
        if backend == "sparse_mla":
            idx = int(getattr(cfg, "index_head_dim", 0) or 0)
            per += idx * dtype_bytes
            what += f" + indexer key {idx}"
        return CacheLayout(what, per, heads * (nope + rope + v) * dtype_bytes, layers)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or (cfg.hidden_size // heads if heads else 0))
    per = 2 * kv_heads * head_dim * dtype_bytes
    return CacheLayout(f"K and V: 2 x {kv_heads} KV heads x {head_dim}", per,
                       2 * heads * head_dim * dtype_bytes, layers)


def _compressed_layout(cfg, block_size: int, dtype, budget: int, lines: list[str]) -> int:
    """DeepSeek V4: the cache per layer type, from the cache layers' own shapes (what
    the engine allocates), and the two pools; returns the main pool's block count."""
    import math

    from lane.config import SchedulerConfig
    from lane.core.kv_cache_utils import plan_kv_pools, window_blocks_needed
    from lane.model_executor.layers.compressed_attention import V4AttentionCache

    types = list(getattr(cfg, "layer_types", None) or [])
    rates = getattr(cfg, "compress_rates", None) or {}
    d, di, W = cfg.head_dim, getattr(cfg, "index_head_dim", 0) or 0, cfg.sliding_window
    dtype_name = str(dtype).removeprefix("torch.")
    lines.append(f"  KV cache per token per layer ({dtype_name}), by layer type:")
    per_block = {"full": 0, "window": 0}
    for kind in dict.fromkeys(types):
        layer = V4AttentionCache(kind, d, W, rates.get(kind, 0), di)
        count = types.count(kind)
        sizes = {n: math.prod(s) * (layer.cache_dtype(n) or dtype).itemsize
                 for n, s in layer.cache_shapes(block_size).items()}
        for n, b in sizes.items():
            per_block[layer.cache_group(n)] += b * count
        main = sum(b for n, b in sizes.items() if layer.cache_group(n) == "full")
        state = sum(math.prod(s) * 4 for s in layer.state_shapes().values())
        parts = ", ".join(f"{n} {'x'.join(map(str, s))}" for n, s in layer.cache_shapes(block_size).items()
                          if layer.cache_group(n) == "full")
        lines.append(f"    {kind}: {main / block_size:,.1f} B x {count} layer{'s' * (count != 1)}"
                     + (f" ({parts} per block; running state {state:,} B per request, float32)" if parts else "")
                     + f" + window K=V {sizes['kv_cache'] / block_size:,.1f} B")
    sc = SchedulerConfig()
    plan = plan_kv_pools(budget, per_block["full"], per_block["window"],
                         window_blocks_needed(W, block_size, sc.max_num_seqs, sc.max_num_batched_tokens))
    dense = 2 * cfg.num_attention_heads * d * dtype.itemsize * len(types)
    per_token = per_block["full"] / block_size
    lines.append(f"  per token, all {len(types)} layers: {per_token:,.1f} B kept for the whole context (a dense "
                 f"MHA cache of the same width: {dense:,} B, {dense / per_token:.0f}x more); a block of "
                 f"{block_size} tokens: {per_block['full']:,} B")
    lines.append(f"  window K=V ({W} tokens, every layer): its own pool of {plan.num_window_blocks - 1:,} blocks "
                 f"of {per_block['window']:,} B (at most half the budget); blocks no query can see any more "
                 f"are released")
    return plan.num_blocks


def explain(model: str | None, dtype: str = "auto", block_size: int | None = None,
            kv_cache_memory_bytes: int | None = None) -> str:
    from lane.config import CacheConfig, ModelConfig

    plugins.load_general_plugins()
    mc = ModelConfig(model, dtype=dtype)
    cfg = mc.hf_config
    block_size = mc.resolve_block_size(block_size)
    lines = [f"model: {mc.gguf_file or mc.model_dir}", "", "1 · registry (which implementation serves it)"]
    archs = mc.architectures
    if not archs:
        lines.append("  config.json has no `architectures`: nothing to look up in the registry "
                     "(add the model class name, e.g. \"LlamaForCausalLM\")")
    else:
        lines.append(f"  architectures: {', '.join(archs)}")
        entry = next(((a, ModelRegistry.get_entry(a)) for a in archs if ModelRegistry.get_entry(a)), None)
        if entry is None:
            lines.append(f"  registered: no. lane has no implementation for {archs[0]}; registered: "
                         f"{', '.join(ModelRegistry.get_supported_archs())}")
            lines.append(f"  a plugin can add one: ModelRegistry.register_model({archs[0]!r}, 'pkg.module:Class') "
                         f"from a '{plugins.GENERAL_PLUGINS_GROUP}' entry point")
        else:
            arch, e = entry
            lines.append(f"  registered: yes, {arch} by {e.source}")
            lines.append(f"  implementation: {e.class_path}")
            for old in e.overrode:
                lines.append(f"  it overrode: {old.class_path} (from {old.source})")
    qc = getattr(cfg, "quantization_config", None)
    if qc:
        qc = qc if isinstance(qc, dict) else qc.to_dict()
        block = "x".join(str(b) for b in qc.get("weight_block_size") or ())
        lines.append(f"  weights: {qc.get('quant_method', '?')} {qc.get('fmt', '')} block-quantised {block} "
                     f"(weight_scale_inv): dequantised on load to {str(mc.dtype).removeprefix('torch.')}")
    if getattr(cfg, "load_error", None):
        lines.append(f"  note: transformers cannot parse this config ({cfg.load_error.splitlines()[0]})")
    choice = platform.select_attention_backend(cfg)
    fields = {k: getattr(cfg, k, None) for k in ("kv_lora_rank", "index_topk", "compress_ratios", "compress_rates",
                                                 "num_key_value_heads", "num_attention_heads")}
    lines += ["", "2 · attention backend (chosen from the config's fields)",
              f"  backend: {choice.name} ({choice.reason})",
              "  fields: " + ", ".join(f"{k}={v}" for k, v in fields.items())]
    dtype_name = str(mc.dtype).removeprefix("torch.")
    budget = CacheConfig(block_size, True, kv_cache_memory_bytes).budget_bytes()
    if choice.name == "compressed":
        blocks = _compressed_layout(cfg, block_size, mc.dtype, budget, lines)
    else:
        layout = cache_layout(cfg, choice.name, BYTES.get(dtype_name, 2))
        per_block = layout.bytes_per_token_layer * layout.num_layers * block_size
        lines += [f"  KV cache per token per layer ({dtype_name}): {layout.what} = "
                  f"{layout.bytes_per_token_layer:,} B"]
        if layout.full_kv_bytes_per_token_layer != layout.bytes_per_token_layer:
            ratio = layout.full_kv_bytes_per_token_layer / layout.bytes_per_token_layer
            lines.append(f"    (full K/V for every head would take {layout.full_kv_bytes_per_token_layer:,} B: "
                         f"{ratio:.1f}x more)")
        lines.append(f"  per token, all {layout.num_layers} layers: "
                     f"{layout.bytes_per_token_layer * layout.num_layers:,} B; "
                     f"a block of {block_size} tokens: {per_block:,} B")
        blocks = budget // per_block if per_block else 0
    lines.append(f"  budget {budget / 2**20:,.1f} MiB -> {blocks:,} blocks, one of them the null block "
                 f"({(blocks - 1) * block_size:,} tokens)")
    return "\n".join(lines)

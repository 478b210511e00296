"""``lane explain MODEL``: the seed's two troubleshooting layers for a model directory or
GGUF file: (1) which implementation the registry resolves its architecture to, and who
registered it; (2) which attention backend its config selects, on which fields, and the
KV cache layout that follows (bytes per token per layer, blocks that fit the budget)."""
from __future__ import annotations

from lane import platform, plugins
from lane.registry import ModelRegistry


def meta_model(mc):
    """The implementation built on the meta device: its layers (and so its cache specs)
    exist, its weights take no memory."""
    import torch

    from lane.model_executor.loader import construct_model

    cls, _ = ModelRegistry.resolve_model_cls(mc.architectures)
    with torch.device("meta"):
        return construct_model(cls, mc)


def _describe(specs: list, cfg) -> str:
    """What one token of one layer keeps, by spec type."""
    from lane.kv_cache_interface import FullAttentionSpec, IndexerKeySpec, KVScaleSpec, MLAAttentionSpec

    parts = []
    for spec in dict.fromkeys(specs):
        if isinstance(spec, FullAttentionSpec):
            parts.append(f"K and V: 2 x {spec.num_kv_heads} KV heads x {spec.head_size}"
                         + (" bytes" if spec.dtype.itemsize == 1 else ""))
        elif isinstance(spec, KVScaleSpec):
            parts.append(f"their scales: 2 x {spec.num_kv_heads} x float32")
        elif isinstance(spec, MLAAttentionSpec):
            latent = int(cfg.kv_lora_rank)
            parts.append(f"latent {latent} + rope key {spec.head_size - latent}")
        elif isinstance(spec, IndexerKeySpec):
            parts.append(f"indexer key {spec.head_size}")
        else:
            parts.append(type(spec).__name__)
    return " + ".join(parts)


def _full_kv_bytes(cfg, dtype) -> int:
    """What plain K and V for every head would take per token per layer."""
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    if getattr(cfg, "kv_lora_rank", None):
        width = int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim) + int(cfg.v_head_dim)
    else:
        width = 2 * int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return heads * width * dtype.itemsize


def _layer_kinds(model, block_size: int, dtype, caching: bool) -> dict[str, list]:
    """Per kind of cache layer (its layer type, else its class): its layers' specs."""
    from lane.model_executor.layers.attention import cache_layers

    kinds: dict[str, list] = {}
    for layer in cache_layers(model).values():
        kind = getattr(layer, "layer_type", None) or type(layer).__name__
        kinds.setdefault(kind, []).append(layer.kv_cache_specs(block_size, dtype, caching))
    return kinds


def _compressed_layout(model, cfg, block_size: int, dtype, caching: bool, lines: list[str], stored: str) -> None:
    """Compressed attention (DeepSeek V4): the cache per layer type, and what prefix
    caching costs (block-edge snapshots)."""
    from lane.kv_cache_interface import FULL, SLIDING_WINDOW, STATE

    lines.append(f"  KV cache per token per layer ({stored}), by layer type:")
    kept = 0
    for kind, layers in _layer_kinds(model, block_size, dtype, caching).items():
        specs = layers[0]
        main = sum(s.page_size_bytes for s in specs.values() if s.kind == FULL)
        window = sum(s.page_size_bytes for s in specs.values() if s.kind == SLIDING_WINDOW)
        state = sum(s.page_size_bytes for s in specs.values() if s.kind == STATE)
        kept += main * len(layers)
        parts = ", ".join(f"{n} {'x'.join(map(str, s.shape))}" for n, s in specs.items() if s.kind == FULL)
        lines.append(f"    {kind}: {main / block_size:,.1f} B x {len(layers)} layer{'s' * (len(layers) != 1)}"
                     + (f" ({parts} per block; running state {state:,} B per request, float32)" if parts else "")
                     + f" + window K=V {window / block_size:,.1f} B")
    other = sum(s.page_size_bytes for layers in _layer_kinds(model, block_size, dtype, not caching).values()
                for specs in layers for s in specs.values() if s.kind == FULL)
    if other != kept:
        on, off = (kept, other) if caching else (other, kept)
        lines.append(f"  kept for the whole context: {on / block_size:,.1f} B per token with prefix caching (its "
                     f"block-edge snapshots let a hit resume compression), {off / block_size:,.1f} B without "
                     f"(--no-enable-prefix-caching); this run: {'on' if caching else 'off'}")
    n_layers = int(cfg.num_hidden_layers)
    dense = 2 * cfg.num_attention_heads * cfg.head_dim * dtype.itemsize * n_layers
    per_token = kept / block_size
    lines.append(f"  per token, all {n_layers} layers: {per_token:,.1f} B kept for the whole context (a dense "
                 f"MHA cache of the same width: {dense:,} B, {dense / per_token:.0f}x more); a block of "
                 f"{block_size} tokens: {kept:,} B; {_million(per_token)}")


def _million(per_token: float) -> str:
    """What a million tokens of context keep, the figure long-context deployments are sized by."""
    return f"1M tokens of context: {per_token * 2**20 / 2**30:,.2f} GiB"


def _parallel_layout(mc, tp: int, expert_parallel: bool, block_size: int, budget: int,
                     caching: bool, sc, eplb=None, dp: int = 1) -> list[str]:
    """Who holds which heads, experts and vocabulary rows; each rank's weights and KV pool (a
    rank-0 model built on the meta device with a group of ``tp`` ranks: its shapes are a rank's)."""
    from lane.core.kv_cache_utils import get_kv_cache_config
    from lane.distributed import parallel_state as ps
    from lane.distributed.layout import describe_layout, num_routed_experts
    from lane.kv_cache_interface import FULL, group_kv_cache_specs
    from lane.model_executor.layers.attention import kv_cache_specs

    saved, placement = (ps.get_tp_group(), ps.get_ep_group()), ps.get_expert_placement()
    ranks = list(range(tp))
    wide = dp > 1 and expert_parallel  # data-parallel attention: experts over every replica's ranks
    ps.set_model_parallel(ps.GroupCoordinator("tp", ranks, 0),
                          ps.GroupCoordinator("ep", list(range(tp * dp)) if wide else ranks if expert_parallel
                                              else [0], 0))
    if eplb is not None:
        ps.set_expert_placement(ps.ExpertPlacement(True, eplb.num_redundant_experts))
    try:
        model = meta_model(mc)
    finally:
        ps.set_model_parallel(*saved)
        ps.set_expert_placement(placement)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    groups = group_kv_cache_specs(kv_cache_specs(model, block_size, mc.dtype, caching))
    kv = get_kv_cache_config(groups, budget // tp, sc.max_num_seqs, sc.max_num_batched_tokens, None)
    main = kv.first_group(FULL)
    per_block = sum(g.page_size_bytes for g in kv.groups if g.kind == FULL)
    lines = ["", f"3 · parallel layout (tensor_parallel_size {tp}"
             + (f", data_parallel_size {dp}: attention data parallel, experts over all {dp * tp} ranks" if wide
                else ", expert parallel: whole experts per rank" if expert_parallel else "") + ")"]
    lines += ["  " + line for line in describe_layout(mc.hf_config, tp, expert_parallel,
                                                      None if eplb is None else eplb.num_redundant_experts,
                                                      dp if wide else 1)]
    if eplb is not None:
        E = num_routed_experts(mc.hf_config)
        lines.append(f"  EPLB: {E} logical experts in {E + eplb.num_redundant_experts} physical slots per MoE layer "
                     f"({eplb.num_redundant_experts} redundant); heat over the last {eplb.window_size} steps, "
                     f"a rearrangement every {eplb.step_interval} steps"
                     + (", one layer's weights moved per step (use_async)" if eplb.use_async else
                        ", every layer's weights moved between two steps"))
    lines.append(f"  each rank: weights {weights / 2**20:,.1f} MiB "
                 + ("(dense shapes; a GGUF's kept blocks take less) " if mc.gguf_file else "")
                 + f"and a KV pool of {kv.num_blocks[main] - 1:,} blocks of {per_block:,} B "
                 f"({budget // tp / 2**20:,.1f} MiB: the budget split over the {tp} ranks on a machine)")
    lines.append("  every rank samples the same token from the gathered logits (same seeds); rank 0's output "
                 "goes back to the engine")
    return lines


def explain(model: str | None, dtype: str = "auto", block_size: int | None = None,
            kv_cache_memory_bytes: int | None = None, enable_prefix_caching: bool = True,
            quantization: str = "auto", tensor_parallel_size: int = 1, enable_expert_parallel: bool = False,
            enable_eplb: bool = False, eplb_config: str | dict | None = None,
            data_parallel_size: int = 1, kv_cache_dtype: str = "auto") -> str:
    from lane.config import CacheConfig, EplbConfig, ModelConfig, ParallelConfig, SchedulerConfig

    plugins.load_general_plugins()
    mc = ModelConfig(model, dtype=dtype, quantization=quantization)
    cfg = mc.hf_config
    pc = ParallelConfig(tensor_parallel_size, data_parallel_size, enable_expert_parallel=enable_expert_parallel,
                        enable_eplb=enable_eplb, eplb_config=EplbConfig.parse(eplb_config))
    pc.check_model(cfg)
    block_size = mc.resolve_block_size(block_size)
    lines = [f"model: {mc.gguf_file or mc.model_dir}", "", "1 · registry (which implementation serves it)"]
    archs = mc.architectures
    entry = None
    if not archs:
        lines.append("  config.json has no `architectures`: nothing to look up in the registry "
                     "(add the model class name, e.g. \"LlamaForCausalLM\")")
    else:
        lines.append(f"  architectures: {', '.join(archs)}")
        entry = next(((a, ModelRegistry.get_entry(a)) for a in archs if ModelRegistry.get_entry(a)), None)
        from lane.model_executor.models import KNOWN_UNSUPPORTED

        known = next((a for a in archs if a in KNOWN_UNSUPPORTED), None)
        if entry is None and known:
            lines.append(f"  registered: no. {known} is known (the seed's registry lists it) and refused: "
                         f"{KNOWN_UNSUPPORTED[known]}")
        elif entry is None:
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
            draft_of = getattr(ModelRegistry.model_class(arch), "draft_of", None)
            if draft_of:  # MTP layers alone: no model to lay out
                lines.append(f"  a draft checkpoint (MTP layers) for {' / '.join(draft_of)}: serve the target with "
                             f"--speculative-config '{{\"method\": \"mtp\", \"model\": \"{mc.model_dir}\"}}'")
                return "\n".join(lines)
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
    if entry is None:
        lines.append("  (the cache layout follows from an implementation's layers: none is registered)")
        return "\n".join(lines)
    from lane.core.kv_cache_utils import blocks_needed, get_kv_cache_config
    from lane.kv_cache_interface import FULL, SLIDING_WINDOW, group_kv_cache_specs
    from lane.model_executor.layers.attention import kv_cache_specs, set_kv_cache_dtype

    # the specs, groups and sizing the engine allocates from, on a weightless model
    from lane.model_executor.loader import planned_weight_bytes

    model = meta_model(mc)
    dtype = mc.dtype
    how = {"auto": "a GGUF's quantized weights in their blocks" if mc.gguf_file else "as stored",
           "none": f"dequantized to {str(dtype).removeprefix('torch.')}" if mc.gguf_file else "as stored",
           "int8": "linear and expert weights int8 per channel (W8A16)",
           "w8a8": "linear and expert weights int8 per channel, activations int8 per token (W8A8)"}
    at = lines.index("2 · attention backend (chosen from the config's fields)") - 1
    lines.insert(at, f"  weights resident: {planned_weight_bytes(mc, model) / 2**20:,.1f} MiB "
                     f"(--quantization {mc.quantization}: {how[mc.quantization]})")
    if mc.gguf_file and mc.quantization == "auto" and dtype.is_floating_point:
        from lane.model_executor.layers import cpu_kernels

        cpu_kernels.build()  # (cached after the first use on this CPU)
        lines.insert(at + 1, f"  kernels here: {cpu_kernels.gguf_kernels(dtype)}")
    set_kv_cache_dtype(model, kv_cache_dtype)
    specs = kv_cache_specs(model, block_size, dtype, enable_prefix_caching)
    groups = group_kv_cache_specs(specs)
    stored = str(dtype).removeprefix('torch.') if kv_cache_dtype == "auto" else f"{kv_cache_dtype}, C8"
    if choice.name == "compressed":
        _compressed_layout(model, cfg, block_size, dtype, enable_prefix_caching, lines, stored)
    else:
        from lane.kv_cache_interface import STATE

        states = {n: s for n, s in specs.items() if s.kind == STATE}  # per request, not per token
        specs = {n: s for n, s in specs.items() if s.kind != STATE}
        n_layers = int(getattr(cfg, "num_hidden_layers", 0) or 1)
        per_layer = sum(s.page_size_bytes for s in specs.values()) // block_size // n_layers
        full_kv = _full_kv_bytes(cfg, dtype)
        lines.append(f"  KV cache per token per layer ({stored}): "
                     f"{_describe(list(specs.values()), cfg)} = {per_layer:,} B")
        if full_kv != per_layer:
            lines.append(f"    (full K/V for every head would take {full_kv:,} B: {full_kv / per_layer:.1f}x more)")
        lines.append(f"  per token, all {n_layers} layers: {per_layer * n_layers:,} B; "
                     f"a block of {block_size} tokens: {per_layer * n_layers * block_size:,} B; "
                     f"{_million(per_layer * n_layers)}")
        if states:
            layers = len({n.rpartition(".")[0] for n in states})
            lines.append(f"  running state (linear attention: convolution and delta-rule state, float32): "
                         f"{sum(s.page_size_bytes for s in states.values()):,} B per request over {layers} layers, "
                         f"one slot per running request")
            if not all(s.prefix_hits for s in states.values()):
                lines.append("  prefix caching: that state is not snapshotted at block edges, so no prefix-cache "
                             "hit could rebuild it: every prompt is computed from its start (hits 0)")
    sc = SchedulerConfig()
    budget = CacheConfig(block_size, enable_prefix_caching, kv_cache_memory_bytes).budget_bytes()
    kv = get_kv_cache_config(groups, budget, sc.max_num_seqs, sc.max_num_batched_tokens, None)
    for g, n in zip(kv.groups, kv.num_blocks):
        if g.kind == SLIDING_WINDOW:
            lines.append(f"  window K=V ({g.sliding_window} tokens, every layer): its own pool of {n - 1:,} blocks "
                         f"of {g.page_size_bytes:,} B (at most half the budget); blocks no query can see any more "
                         f"are released")
    main = kv.first_group(FULL)
    lines.append(f"  budget {budget / 2**20:,.1f} MiB -> {kv.num_blocks[main]:,} blocks, one of them the null block "
                 f"({(kv.num_blocks[main] - 1) * block_size:,} tokens)")
    need = blocks_needed(mc.max_model_len, block_size)
    if kv.num_blocks[main] < need:
        lines.append(f"  one request of the whole context (max_model_len {mc.max_model_len:,}) needs {need:,} blocks: "
                     f"the engine refuses this budget unless --max-model-len is lower")
    if tensor_parallel_size > 1 or enable_expert_parallel:
        lines += _parallel_layout(mc, tensor_parallel_size, enable_expert_parallel, block_size, budget,
                                  enable_prefix_caching, sc, pc.eplb_config if enable_eplb else None,
                                  data_parallel_size)
    return "\n".join(lines)

"""Which layouts a model can be split into (refused at start with the numbers, as vLLM
refuses them), and who holds what under a layout (``lane explain``)."""
from __future__ import annotations


def _is_v4(cfg) -> bool:
    return "DeepseekV4ForCausalLM" in (getattr(cfg, "architectures", None) or [])


def num_routed_experts(cfg) -> int:
    """Routed experts per MoE layer (DeepSeek's n_routed_experts, Qwen-MoE's num_experts); 0: dense."""
    return int(getattr(cfg, "n_routed_experts", None) or getattr(cfg, "num_experts", None) or 0)


_experts = num_routed_experts


def check_eplb(cfg, ep: int, redundant: int) -> None:
    """--enable-eplb: a MoE model whose physical experts (logical + redundant) divide over the
    expert-parallel ranks; the message says which numbers to change."""
    E = _experts(cfg)
    if not E:
        raise ValueError("--enable-eplb balances routed experts; this model has none")
    if (E + redundant) % ep:
        fix = (-E) % ep
        raise ValueError(f"--enable-eplb: num_experts {E} + num_redundant_experts {redundant} = {E + redundant} "
                         f"physical experts do not divide over the {ep} expert-parallel ranks; set "
                         f"num_redundant_experts in --eplb-config to {fix} (or {fix} plus a multiple of {ep}), "
                         f"or change -tp")


def check_layout(cfg, tp: int, expert_parallel: bool, redundant: int = 0, ep: int | None = None) -> None:
    """Raise ValueError naming the first size that ``tp`` does not divide (``redundant``: EPLB's
    extra expert slots, which --enable-eplb's own check explains; ``ep``: the ranks the experts
    spread over when not tp, dp x tp under data-parallel attention)."""
    ep = ep or tp
    if expert_parallel and not _experts(cfg):
        raise ValueError("--enable-expert-parallel needs a model with routed experts; this one has none")
    if expert_parallel and not redundant and _experts(cfg) % ep:
        raise ValueError(f"expert-parallel size {ep} does not divide {_experts(cfg)} routed experts")
    if tp == 1:
        return
    checks: list[tuple[str, int]] = [("attention heads", cfg.num_attention_heads)]
    kv = getattr(cfg, "num_key_value_heads", None)
    if kv and not getattr(cfg, "kv_lora_rank", None) and not _is_v4(cfg):
        if kv >= tp:
            checks.append(("KV heads", kv))
        elif tp % kv:  # fewer KV heads than ranks: each is replicated on tp / kv ranks
            raise ValueError(f"tensor_parallel_size {tp} is not a multiple of the {kv} KV heads "
                             f"(fewer KV heads than ranks are replicated, tp / kv ranks each)")
    dense_layers = getattr(cfg, "first_k_dense_replace", 0) or getattr(cfg, "mlp_only_layers", None)
    if getattr(cfg, "intermediate_size", None) and (not _experts(cfg) or dense_layers):
        checks.append(("intermediate_size", cfg.intermediate_size))
    if _experts(cfg):
        if not expert_parallel:
            checks.append(("moe_intermediate_size", cfg.moe_intermediate_size))
        shared = getattr(cfg, "n_shared_experts", 0) or 0
        if shared:
            checks.append(("shared experts' intermediate size", cfg.moe_intermediate_size * shared))
    if getattr(cfg, "index_n_heads", None) and getattr(cfg, "index_topk", None):
        checks.append(("indexer heads", cfg.index_n_heads))
    if _is_v4(cfg):
        checks.append(("output groups (o_groups)", cfg.o_groups))
    for what, n in checks:
        if n % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide {n} {what}")


def _span(what: str, start: int, n: int) -> str:
    return f"{what} {start}" if n == 1 else f"{what}s {start}-{start + n - 1}"


def describe_layout(cfg, tp: int, expert_parallel: bool, eplb_redundant: int | None = None,
                    dp: int = 1) -> list[str]:
    """One line per rank: the heads, KV heads, experts, vocabulary rows and token rows it holds
    (``eplb_redundant``: EPLB is on with that many redundant experts, and the experts are its
    initial placement's slots; ``dp`` > 1: data-parallel attention, dp replicas of tp ranks with
    the experts over all of them)."""
    lines = []
    H = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or H
    mla = bool(getattr(cfg, "kv_lora_rank", None))
    V = cfg.vocab_size
    shard = -(-V // tp)
    E = _experts(cfg)
    ep = tp * dp
    for rank in range(ep):
        d, r = divmod(rank, tp)
        h = H // tp
        who = f"rank {rank} (replica {d}, tp rank {r})" if dp > 1 else f"rank {r}"
        parts = [f"{who}: {_span('query head', r * h, h)}"]
        if _is_v4(cfg):
            g = cfg.o_groups // tp
            parts.append(f"{_span('output group', r * g, g)}, the shared K=V head and mHC replicated")
        elif mla:
            parts.append("the whole latent cache (MLA: replicated per rank)")
        elif kv >= tp:
            k = kv // tp
            parts.append(_span("KV head", r * k, k))
        else:
            parts.append(f"KV head {r // (tp // kv)} (replicated on {tp // kv} ranks)")
        if E:
            if eplb_redundant is not None:
                from lane.eplb.placement import initial_phy2log

                per = (E + eplb_redundant) // ep
                held = initial_phy2log(1, E, E + eplb_redundant)[0, rank * per:(rank + 1) * per].tolist()
                parts.append(f"{_span('slot', rank * per, per)} holding experts {held} (EPLB's initial placement)")
            elif expert_parallel:
                e = E // ep
                parts.append(f"{_span('expert', rank * e, e)} whole")
            else:
                parts.append(f"1/{tp} of every expert's intermediate")
        parts.append(f"vocabulary rows {r * shard}-{min(V, (r + 1) * shard) - 1}")
        if dp > 1:
            parts.append(f"token rows: replica {d}'s own requests; it routes {'its' if tp == 1 else f'1/{tp} of'} "
                         f"rows to the experts' ranks by all-to-all")
        lines.append(", ".join(parts))
    return lines

"""Paged attention on the KV cache (seed steps 24 and 27).

The cache of one layer is ``[num_blocks, num_kv_heads, block_size, head_dim]``
for K and for V: head-major inside a block, so one head's tokens of a block are
one contiguous run (what the decode kernel streams, and what SDPA wants).
Each step's batch is flattened: query-length-1 requests (decodes) come first
and are attended in one batched call; prefill chunks follow, one call each. Block 0 is a zeroed null block that pads block tables.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from lane import tracing
from lane.tracing import Step
from lane.model_executor.layers import cpu_kernels


@dataclass
class PrefillSpan:
    query_start: int  # rows [query_start, query_end) of the flattened batch
    query_end: int
    num_computed: int  # tokens of this request already in the cache before the chunk
    block_ids: torch.Tensor  # the request's blocks covering num_computed + chunk
    state_slot: int = 0  # running-state slot (compressed attention)
    fresh: bool = False  # the request's first chunk since admission: its running state starts here
    window_block_ids: torch.Tensor | None = None  # its sliding-window group's table


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot of each token (block * block_size + offset)
    num_decodes: int = 0  # leading rows that are query-length-1 requests
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks], null-padded
    decode_context_lens: torch.Tensor | None = None  # [B] int32
    decode_state_slots: list[int] | None = None  # [B] running-state slots (compressed attention)
    window_slot_mapping: torch.Tensor | None = None  # [T] slots in the sliding-window group's pool
    decode_window_tables: torch.Tensor | None = None  # [B, max_blocks] its block tables
    prefills: list[PrefillSpan] = field(default_factory=list)


_metadata: AttentionMetadata | None = None


@contextmanager
def set_attention_metadata(md: AttentionMetadata):
    global _metadata
    prev, _metadata = _metadata, md
    try:
        yield
    finally:
        _metadata = prev


def get_attention_metadata() -> AttentionMetadata:
    if _metadata is None:
        raise RuntimeError("attention called outside a model-runner step")
    return _metadata


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[..., n] block ids -> [..., kv_heads, n * block_size, head_dim] (a copy)."""
    nb, kvh, bs, d = cache.shape
    lead = block_ids.shape[:-1]
    g = cache.index_select(0, block_ids.reshape(-1)).view(*lead, block_ids.shape[-1], kvh, bs, d)
    return g.transpose(-4, -3).reshape(*lead, kvh, -1, d)


def decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Reference path: gather each request's blocks, pad, one batched softmax."""
    B, H, D = q.shape
    kvh = k_cache.shape[1]
    k = gather_blocks(k_cache, block_tables)  # [B, kvh, L, D]
    v = gather_blocks(v_cache, block_tables)
    L = k.shape[2]
    g = H // kvh
    s = torch.matmul(q.view(B, kvh, g, D), k.transpose(-1, -2)).float() * scale  # [B,kvh,g,L]
    pad = torch.arange(L) >= context_lens.to(torch.long)[:, None]
    s.masked_fill_(pad[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).to(q.dtype)
    return torch.matmul(p, v).reshape(B, H, D)


class CacheLayer(nn.Module):
    """A module that keeps per-token state in the paged cache (K/V, an MLA latent,
    indexer keys). The runner allocates ``[num_blocks, *shape]`` for every entry of
    ``cache_shapes`` and sets it as the attribute of that name; every cache layer
    shares the requests' block tables."""

    def cache_shapes(self, block_size: int) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    def cache_dtype(self, name: str) -> torch.dtype | None:
        """A cache tensor's dtype when it is not the model's."""
        return None

    def cache_group(self, name: str) -> str:
        """"full" (the main pool) or "window" (the sliding-window group's own pool)."""
        return "full"

    @property
    def sliding_window(self) -> int:
        """Tokens the window group keeps visible (0: this layer has no window group)."""
        return 0

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-request running state (float32), one slot per running request; most
        layers keep none."""
        return {}


class Attention(CacheLayer):
    """Writes this layer's K/V into the paged cache, then attends."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def cache_shapes(self, block_size: int) -> dict[str, tuple[int, ...]]:
        shape = (self.num_kv_heads, block_size, self.head_dim)
        return {"k_cache": shape, "v_cache": shape}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KV, D] -> [T, H*D]"""
        md = get_attention_metadata()
        kc, vc = self.k_cache, self.v_cache
        if kc.numel():  # step 24: K/V into their slots
            bs = kc.shape[2]
            blk, off = md.slot_mapping // bs, md.slot_mapping % bs
            kc[blk, :, off] = k
            vc[blk, :, off] = v
        mark = tracing.forward_mark()
        mark(Step.OPS_KV_WRITE)
        out = torch.empty_like(q)
        nd = md.num_decodes
        if nd:
            args = (q[:nd], kc, vc, md.decode_block_tables, md.decode_context_lens, self.scale)
            out[:nd] = (cpu_kernels.decode_attention(*args) if cpu_kernels.usable(q)
                        else decode_attention_torch(*args))
        for span in md.prefills:
            s, e = span.query_start, span.query_end
            out[s:e] = self._prefill(q[s:e], k[s:e], v[s:e], span, kc, vc)
        mark(Step.OPS_ATTENTION)
        return out.view(q.shape[0], -1)

    def _prefill(self, q, k, v, span: PrefillSpan, kc, vc) -> torch.Tensor:
        n = q.shape[0]
        mask, causal = None, True
        if span.num_computed:  # earlier tokens come from the cache
            total = span.num_computed + n
            k = gather_blocks(kc, span.block_ids)[:, :total]  # [kvh, total, D]
            v = gather_blocks(vc, span.block_ids)[:, :total]
            mask = torch.arange(total)[None, :] <= torch.arange(span.num_computed, total)[:, None]
            causal = False
        else:
            k, v = k.transpose(0, 1), v.transpose(0, 1)
        g = self.num_heads // self.num_kv_heads
        if g > 1:  # expanded heads + 4-D inputs take torch's flash kernel on CPU (GQA does not)
            k, v = k.repeat_interleave(g, dim=0), v.repeat_interleave(g, dim=0)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None],
                                           attn_mask=mask, is_causal=causal, scale=self.scale)
        return o[0].transpose(0, 1)

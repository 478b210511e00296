"""Paged attention on the KV cache (seed steps 24 and 27).

The cache of one layer is ``[num_blocks, block_size, num_kv_heads, head_dim]``
for K and for V. Each step's batch is flattened: query-length-1 requests
(decodes) come first and are attended in one batched call; prefill chunks
follow, one call each. Block 0 is a zeroed null block that pads block tables.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from lane.model_executor.layers import cpu_kernels


@dataclass
class PrefillSpan:
    query_start: int  # rows [query_start, query_end) of the flattened batch
    query_end: int
    num_computed: int  # tokens of this request already in the cache before the chunk
    block_ids: torch.Tensor  # the request's blocks covering num_computed + chunk


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot of each token
    num_decodes: int = 0  # leading rows that are query-length-1 requests
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks], null-padded
    decode_context_lens: torch.Tensor | None = None  # [B] int32
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


def decode_attention_torch(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Reference path: gather each request's blocks, pad, one batched softmax."""
    B, H, D = q.shape
    nb, bs, kvh, _ = k_cache.shape
    max_blocks = block_tables.shape[1]
    L = max_blocks * bs
    flat = block_tables.reshape(-1)
    k = k_cache.view(nb, -1).index_select(0, flat).view(B, L, kvh, D)
    v = v_cache.view(nb, -1).index_select(0, flat).view(B, L, kvh, D)
    g = H // kvh
    s = torch.matmul(q.view(B, kvh, g, D), k.permute(0, 2, 3, 1)).float() * scale  # [B,kvh,g,L]
    pad = torch.arange(L) >= context_lens.to(torch.long)[:, None]
    s.masked_fill_(pad[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).to(q.dtype)
    return torch.matmul(p, v.transpose(1, 2)).reshape(B, H, D)


class Attention(nn.Module):
    """Writes this layer's K/V into the paged cache, then attends."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KV, D] -> [T, H*D]"""
        md = get_attention_metadata()
        kc, vc = self.k_cache, self.v_cache
        if kc.numel():  # step 24: K/V into their slots
            kc.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, md.slot_mapping, k)
            vc.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, md.slot_mapping, v)
        out = torch.empty_like(q)
        nd = md.num_decodes
        if nd:
            args = (q[:nd], kc, vc, md.decode_block_tables, md.decode_context_lens, self.scale)
            out[:nd] = (cpu_kernels.decode_attention(*args) if cpu_kernels.usable(q)
                        else decode_attention_torch(*args))
        for span in md.prefills:
            s, e = span.query_start, span.query_end
            out[s:e] = self._prefill(q[s:e], k[s:e], v[s:e], span, kc, vc)
        return out.view(q.shape[0], -1)

    def _prefill(self, q, k, v, span: PrefillSpan, kc, vc) -> torch.Tensor:
        n = q.shape[0]
        if span.num_computed == 0:  # no context in the cache: plain causal attention
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                is_causal=True, scale=self.scale, enable_gqa=True)
            return o.transpose(0, 1)
        total = span.num_computed + n
        bs = kc.shape[1]
        ks = kc.index_select(0, span.block_ids).view(-1, self.num_kv_heads, self.head_dim)[:total]
        vs = vc.index_select(0, span.block_ids).view(-1, self.num_kv_heads, self.head_dim)[:total]
        qpos = torch.arange(span.num_computed, total)
        mask = torch.arange(total)[None, :] <= qpos[:, None]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
            attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o.transpose(0, 1)

"""Paged attention on the KV cache (seed steps 24 and 27).

The cache of one layer is ``[num_blocks, num_kv_heads, block_size, head_dim]``
for K and for V: head-major inside a block, so one head's tokens of a block are
one contiguous run (what the decode kernel streams, and what SDPA wants).
Each step's batch is flattened: query-length-1 requests (decodes) come first
and are attended in one batched call; prefill chunks follow, one call each. Block 0 is a
zeroed null block that pads block tables. ``CacheLayer`` is what every cache-holding
layer is: it declares its cache tensors as specs and reads its group's metadata.
"""
from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from lane import platform, tracing
from lane.attention.metadata import PagedAttentionMetadata, PrefillSpan, get_forward_context
from lane.kv_cache_interface import FullAttentionSpec, KVCacheSpec
from lane.model_executor.layers import cpu_kernels
from lane.tracing import Step


# Prefill attention: "rows" runs each row of a chunk as the decode kernel runs a decode row
# (cpu_kernels.prefill_rows_attention: batch-invariant), "kernel" the flash-style prefill kernel
# (cpu_kernels.prefill_attention), "torch" gathers the request's blocks and runs SDPA (the path
# for other devices and when the kernels are unavailable); "auto" (default): "rows" when
# batch-invariant (cpu_kernels.BATCH_INVARIANT), else the faster of the other two on this CPU.
PREFILL_ATTENTION = os.environ.get("LANE_PREFILL_ATTENTION", "auto")


def prefill_kernel_for(q: torch.Tensor) -> bool:
    """Whether a prefill chunk takes the paged kernel. Measured (benchmarks/prefill_attention.py,
    Sapphire Rapids): in float32 the kernel beats gather + SDPA at every context, a fresh
    chunk's (SDPA flash on the chunk's own k/v) included; in bf16 on a CPU with AMX or
    AVX512-BF16, SDPA's oneDNN matmuls outrun the kernel's fp32 arithmetic per core (1.3-1.6x
    at 2k-7k context, one thread) even with the gather, so SDPA stays there."""
    if PREFILL_ATTENTION == "torch" or not cpu_kernels.usable(q):
        return False
    return PREFILL_ATTENTION == "kernel" or q.dtype != torch.bfloat16 or not platform.cpu_has_fast_bf16()


def prefill_rows_for(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether a prefill chunk runs row by row on the decode kernel (see PREFILL_ATTENTION)."""
    if not cpu_kernels.usable(q) or k_cache.dtype != q.dtype:
        return False
    return PREFILL_ATTENTION == "rows" or (PREFILL_ATTENTION == "auto" and cpu_kernels.BATCH_INVARIANT)


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


def prefill_attention_torch(q, k, v, k_cache, v_cache, block_ids, num_computed, scale):
    """Reference path for one chunk (q [n, H, D], its own k, v [n, KVH, D]): with cached
    context, gather the request's blocks; expand GQA heads; SDPA."""
    n, H = q.shape[0], q.shape[1]
    mask, causal = None, True
    if num_computed:  # earlier tokens come from the cache
        total = num_computed + n
        k = gather_blocks(k_cache, block_ids)[:, :total]  # [kvh, total, D]
        v = gather_blocks(v_cache, block_ids)[:, :total]
        mask = torch.arange(total)[None, :] <= torch.arange(num_computed, total)[:, None]
        causal = False
    else:
        k, v = k.transpose(0, 1), v.transpose(0, 1)
    g = H // k.shape[0]
    if g > 1:  # expanded heads + 4-D inputs take torch's flash kernel on CPU (GQA does not)
        k, v = k.repeat_interleave(g, dim=0), v.repeat_interleave(g, dim=0)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None],
                                       attn_mask=mask, is_causal=causal, scale=scale)
    return o[0].transpose(0, 1)


class CacheLayer(nn.Module):
    """A module that keeps state in the KV cache (K/V, an MLA latent, indexer keys,
    compressed entries, running state). It declares one ``KVCacheSpec`` per cache tensor;
    the runner allocates each tensor in its group's pool and binds it here, with the
    group's index, which is where the layer finds its metadata each step."""
    # its decode path writes every row's cache entries before any row attends, then treats
    # each row on its own (its context length): a request's several rows (drafts to verify)
    # may then be decode rows, each seeing the cache up to itself
    decode_rows_independent = False

    def __init__(self) -> None:
        super().__init__()
        self.kv_cache_group: dict[str, int] = {}  # cache tensor name -> its KV cache group

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype,
                       enable_prefix_caching: bool) -> dict[str, KVCacheSpec]:
        raise NotImplementedError

    def bind_kv_cache(self, name: str, tensor: torch.Tensor, group: int) -> None:
        setattr(self, name, tensor)
        self.kv_cache_group[name] = group

    def attn_metadata(self, name: str):
        """This step's metadata of the group that holds cache tensor ``name``."""
        return get_forward_context().attn_metadata[self.kv_cache_group[name]]

    def keep_verified(self, rows_by_slot: dict[int, int]) -> None:
        """After a step that verified drafts: the requests (by running-state slot) keep only
        their first ``rows`` rows of the step. Slots written by rejected rows are overwritten
        when their positions come again, so only running state must fall back."""


class Attention(CacheLayer):
    """Writes this layer's K/V into the paged cache, then attends."""
    decode_rows_independent = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype,
                       enable_prefix_caching: bool) -> dict[str, KVCacheSpec]:
        spec = FullAttentionSpec(block_size, dtype, self.num_kv_heads, self.head_dim)
        return {"k_cache": spec, "v_cache": spec}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KV, D] -> [T, H*D]"""
        md: PagedAttentionMetadata = self.attn_metadata("k_cache")
        kc, vc = self.k_cache, self.v_cache
        if kc.numel():  # step 24: K/V into their slots
            if cpu_kernels.usable(k) and k.dtype == kc.dtype:
                cpu_kernels.cache_write(k, v, kc, vc, md.slot_mapping)
            else:
                bs = kc.shape[2]
                blk, off = md.slot_mapping // bs, md.slot_mapping % bs
                kc[blk, :, off] = k
                vc[blk, :, off] = v
        mark = tracing.forward_mark()
        mark(Step.OPS_KV_WRITE)
        nd = md.num_decodes
        decode = cpu_kernels.decode_attention if cpu_kernels.usable(q) else decode_attention_torch
        if nd and nd == q.shape[0]:  # decodes only: no output copy
            out = decode(q, kc, vc, md.decode_block_tables, md.decode_context_lens, self.scale)
            mark(Step.OPS_ATTENTION)
            return out.reshape(q.shape[0], -1)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = decode(q[:nd], kc, vc, md.decode_block_tables, md.decode_context_lens, self.scale)
        for span in md.prefills:
            s, e = span.query_start, span.query_end
            out[s:e] = self._prefill(q[s:e], k[s:e], v[s:e], span, kc, vc)
        mark(Step.OPS_ATTENTION)
        return out.view(q.shape[0], -1)

    def _prefill(self, q, k, v, span: PrefillSpan, kc, vc) -> torch.Tensor:
        if kc.numel() and prefill_rows_for(q, kc):
            return cpu_kernels.prefill_rows_attention(q, kc, vc, span.block_ids, span.num_computed, self.scale)
        if kc.numel() and prefill_kernel_for(q):  # the chunk's K/V are in the cache already
            return cpu_kernels.prefill_attention(q, kc, vc, span.block_ids, span.num_computed, self.scale)
        return prefill_attention_torch(q, k, v, kc, vc, span.block_ids, span.num_computed, self.scale)


def cache_layers(model: nn.Module) -> dict[str, CacheLayer]:
    """The model's cache-holding modules by name, but those under the prefixes a model
    lists in ``kv_cache_skip`` (layers its forward does not run, as DeepSeek's MTP layer)."""
    skip = tuple(getattr(model, "kv_cache_skip", ()))
    return {name: m for name, m in model.named_modules()
            if isinstance(m, CacheLayer) and not name.startswith(skip)}


def kv_cache_specs(model: nn.Module, block_size: int, dtype: torch.dtype,
                   enable_prefix_caching: bool) -> dict[str, KVCacheSpec]:
    """Every cache tensor's spec, named "<module>.<tensor>": what the engine allocates
    and what `lane explain` reports."""
    return {f"{name}.{attr}": spec for name, layer in cache_layers(model).items()
            for attr, spec in layer.kv_cache_specs(block_size, dtype, enable_prefix_caching).items()}

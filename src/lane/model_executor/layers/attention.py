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
from lane.kv_cache_interface import KV_CACHE_DTYPES, FullAttentionSpec, KVCacheSpec, KVScaleSpec
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


_CEILING = {"int8": 127.0, "fp8_e4m3": 448.0}  # the largest stored magnitude


def quantize_rows_8bit(x: torch.Tensor, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (bytes [..., D]: int8, or fp8 e4m3 as uint8; scales [...] float32), one
    scale per row: absmax / 127 (int8) or / 448 (fp8)."""
    xf = x.float()
    scale = xf.abs().amax(-1) / _CEILING["fp8_e4m3" if fp8 else "int8"]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = xf * (1.0 / scale)[..., None]
    q = y.to(torch.float8_e4m3fn).view(torch.uint8) if fp8 else y.round().to(torch.int8)
    return q, scale


def dequantize_8bit(q: torch.Tensor, scale: torch.Tensor, fp8: bool) -> torch.Tensor:
    vals = q.view(torch.float8_e4m3fn).float() if fp8 else q.float()
    return vals * scale[..., None]


def attention_8bit_torch(q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, scale, fp8: bool,
                         blocks_per_pass: int = 32):
    """The torch path over an 8-bit cache: q [B, H, D], one query per row at context_lens
    [B]; an online softmax over ``blocks_per_pass`` blocks at a time, each pass dequantizing
    only its blocks (never a copy of the whole context)."""
    B, H, D = q.shape
    kvh, bs = k_cache.shape[1], k_cache.shape[2]
    g = H // kvh
    if block_tables.dim() == 1:  # one request's table for every row (a prefill chunk's rows)
        block_tables = block_tables.expand(B, -1)
    qf = q.float().view(B, kvh, g, D) * scale
    m = torch.full((B, kvh, g, 1), float("-inf"))
    l = torch.zeros(B, kvh, g, 1)
    acc = torch.zeros(B, kvh, g, D)
    lens = context_lens.to(torch.long)
    for j in range(0, -(-int(lens.max()) // bs), blocks_per_pass):
        ids = block_tables[:, j:j + blocks_per_pass]
        n = ids.shape[1] * bs

        def deq(c, s):
            vals = gather_blocks(c, ids)  # [B, kvh, n, D] bytes: this pass's blocks only
            sc = s.index_select(0, ids.reshape(-1)).view(B, -1, kvh, bs).transpose(1, 2).reshape(B, kvh, n)
            return dequantize_8bit(vals, sc, fp8)

        k, v = deq(k_cache, k_scale), deq(v_cache, v_scale)
        s = torch.matmul(qf, k.transpose(-1, -2))  # [B, kvh, g, n]
        pos = j * bs + torch.arange(n)
        s.masked_fill_((pos[None, :] >= lens[:, None])[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        c = torch.where(m == float("-inf"), torch.zeros_like(m), torch.exp(m - m_new))
        p = torch.exp(s - m_new)
        l = l * c + p.sum(-1, keepdim=True)
        acc = acc * c + torch.matmul(p, v)
        m = m_new
    return (acc / l).reshape(B, H, D).to(q.dtype)


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
    c8_pass_blocks = 64  # C8: cached rows read (and dequantized) this many blocks at a time
    # C8: whether it can keep its cache in 8 bits, and the storage chosen (set_kv_cache_dtype)
    supports_8bit_cache = False
    kv_cache_dtype = "auto"

    def __init__(self) -> None:
        super().__init__()
        self.kv_cache_group: dict[str, int] = {}  # cache tensor name -> its KV cache group

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype,
                       enable_prefix_caching: bool) -> dict[str, KVCacheSpec]:
        raise NotImplementedError

    def bind_kv_cache(self, name: str, tensor: torch.Tensor, group: int) -> None:
        setattr(self, name, tensor)
        self.kv_cache_group[name] = group

    # -- C8: how this layer's caches are stored ----------------------------------------
    def stored_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """What its caches hold: ``dtype`` (the model's), or C8's bytes (int8; fp8 e4m3 as uint8)."""
        return {"auto": dtype, "int8": torch.int8}.get(self.kv_cache_dtype, torch.uint8)

    @property
    def fp8_cache(self) -> bool:
        return self.kv_cache_dtype == "fp8_e4m3"

    def c8_passes(self, n: int, per_block: int = 1) -> list[tuple[int, int]]:
        """The ranges [lo, hi) of ``n`` cached rows (``per_block`` of them a block) read at once:
        all of them, or under C8 ``c8_pass_blocks`` blocks' worth at a time, each pass
        dequantized alone (never a copy of a request's whole context)."""
        step = n if self.kv_cache_dtype == "auto" else self.c8_pass_blocks * per_block
        return [(j, min(j + step, n)) for j in range(0, n, max(step, 1))]

    def write_rows(self, cache: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Rows [n, D] into the flat slots of a cache whose slots are rows of D (one head a
        slot): as they are, or under C8 quantized, each row's scale into ``scale``'s same slot."""
        flat = cache.view(-1, cache.shape[-1])
        if self.kv_cache_dtype == "auto":
            flat[slots] = rows.to(cache.dtype)
        else:
            flat[slots], scale.view(-1)[slots] = quantize_rows_8bit(rows, self.fp8_cache)

    def read_rows(self, cache: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """The rows of ``slots`` (any shape) -> [..., D]: as stored, or under C8 dequantized."""
        rows = cache.view(-1, cache.shape[-1])[slots]
        if self.kv_cache_dtype == "auto":
            return rows
        return dequantize_8bit(rows, scale.view(-1)[slots], self.fp8_cache)

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
    supports_8bit_cache = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.k_scale = torch.empty(0)
        self.v_scale = torch.empty(0)

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype,
                       enable_prefix_caching: bool) -> dict[str, KVCacheSpec]:
        spec = FullAttentionSpec(block_size, self.stored_dtype(dtype), self.num_kv_heads, self.head_dim)
        if self.kv_cache_dtype == "auto":
            return {"k_cache": spec, "v_cache": spec}
        scales = KVScaleSpec(block_size, torch.float32, self.num_kv_heads)
        return {"k_cache": spec, "v_cache": spec, "k_scale": scales, "v_scale": scales}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, KV, D] -> [T, H*D]"""
        if self.kv_cache_dtype != "auto" and self.k_cache.numel():
            return self._forward_8bit(q, k, v)
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

    def _forward_8bit(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """C8: K/V quantized into their slots (step 24); decode rows, and every row of a prefill
        chunk, attended by the paged kernel over the 8-bit cache (step 27)."""
        md: PagedAttentionMetadata = self.attn_metadata("k_cache")
        kc, vc, ks, vs = self.k_cache, self.v_cache, self.k_scale, self.v_scale
        fp8 = self.fp8_cache
        if cpu_kernels.usable(k):
            cpu_kernels.cache_write_8bit(k, v, kc, vc, ks, vs, md.slot_mapping, fp8)
        else:
            bs = kc.shape[2]
            blk, off = md.slot_mapping // bs, md.slot_mapping % bs
            kc[blk, :, off], ks[blk, :, off] = quantize_rows_8bit(k, fp8)
            vc[blk, :, off], vs[blk, :, off] = quantize_rows_8bit(v, fp8)
        mark = tracing.forward_mark()
        mark(Step.OPS_KV_WRITE)
        attend = cpu_kernels.decode_attention_8bit if cpu_kernels.usable(q) else attention_8bit_torch
        out = torch.empty_like(q)
        nd = md.num_decodes
        if nd:
            out[:nd] = attend(q[:nd], kc, vc, ks, vs, md.decode_block_tables, md.decode_context_lens, self.scale, fp8)
        for span in md.prefills:  # each row at its own context length, as a decode row
            s, e = span.query_start, span.query_end
            lens = torch.arange(span.num_computed + 1, span.num_computed + e - s + 1, dtype=torch.int32)
            out[s:e] = attend(q[s:e], kc, vc, ks, vs, span.block_ids, lens, self.scale, fp8)
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


def set_kv_cache_dtype(model: nn.Module, kind: str) -> None:
    """--kv-cache-dtype: the storage of every cache layer's tensors; 8 bits (C8) only where
    every layer can keep them so, else a ValueError naming the ones that cannot."""
    if kind not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {kind!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
    layers = cache_layers(model)
    if kind != "auto":
        unable = sorted({type(m).__name__ for m in layers.values() if not m.supports_8bit_cache})
        if unable:
            raise ValueError(f"--kv-cache-dtype {kind}: this model's {', '.join(unable)} caches are not kept in "
                             f"8 bits yet (paged K/V attention is); use --kv-cache-dtype auto")
    for m in layers.values():
        m.kv_cache_dtype = kind


def kv_cache_specs(model: nn.Module, block_size: int, dtype: torch.dtype,
                   enable_prefix_caching: bool) -> dict[str, KVCacheSpec]:
    """Every cache tensor's spec, named "<module>.<tensor>": what the engine allocates
    and what `lane explain` reports."""
    return {f"{name}.{attr}": spec for name, layer in cache_layers(model).items()
            for attr, spec in layer.kv_cache_specs(block_size, dtype, enable_prefix_caching).items()}

"""Multi-head latent attention on a latent paged cache (seed steps 24 and 27).

The cache keeps, per token per layer, only the normalised KV latent
(``kv_lora_rank``) and the roped shared key (``qk_rope_head_dim``):
``[num_blocks, 1, block_size, kv_lora_rank + rope]``. Full K/V for every head
never reach the cache.

- Prefill chunks expand the latent of the whole context through ``kv_b_proj``
  into per-head K and V and run ordinary attention (compute-bound: the expanded
  form is cheaper when many queries share the keys).
- Decodes use the absorbed form: ``W_UK`` is folded into the query, so each head
  attends in latent space against the cache as it is (one shared "KV head" of
  width ``kv_lora_rank + rope``), and ``W_UV`` maps the latent output back to
  ``v_head_dim``. Memory-bound decode then reads 576 values per token (DeepSeek
  V3) instead of 128 heads x 384.

With a lightning indexer (DSA, DeepSeek V3.2) the attention covers only the
tokens it selected; see ``indexer.py``. Under DSA context parallelism a prefill
step's rows are split over the ranks, each attending its rows with every head
(``context_parallel.py``): those rows use the absorbed form too, against the
latent of the tokens they may see, so ``kv_b_proj`` is expanded for no context.

C8 (``--kv-cache-dtype int8 / fp8_e4m3``): the latent entry is stored a byte a value with one
scale per token (``kv_scale``). Decodes read it through the 8-bit paged kernel; a prefill
chunk's rows are attended as decode rows in the absorbed form (the kernel over the context, or
the indexer's chosen tokens only), never through a dequantized copy of the context.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lane import tracing
from lane.tracing import Step
from lane.model_executor.layers import cpu_kernels
from lane.attention.metadata import PagedAttentionMetadata, PrefillSpan
from lane.kv_cache_interface import KVCacheSpec, KVScaleSpec, MLAAttentionSpec
from lane.model_executor.layers.attention import CacheLayer, attention_8bit_torch, decode_attention_torch, gather_blocks
from lane.model_executor.layers.context_parallel import RowWindow, mark_context_gathered
from lane.model_executor.layers.indexer import SparseSelection
from lane.model_executor.layers.linear import Linear


class MLAAttention(CacheLayer):
    decode_rows_independent = True
    supports_8bit_cache = True

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, scale: float, kv_b_proj: Linear, head_offset: int = 0) -> None:
        super().__init__()
        # the heads kv_b_proj holds; a query with fewer (a decode split by heads while kv_b_proj is
        # whole, under DSA context parallelism) is heads [head_offset, ...) of them
        self.num_heads = num_heads
        self.head_offset = head_offset
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.scale = scale
        self._kv_b_proj = (kv_b_proj,)  # a tuple: owned (and loaded) by the model's attention module
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None
        self.kv_cache = torch.empty(0)
        self.kv_scale = torch.empty(0)

    @property
    def c8(self) -> bool:
        return self.kv_cache_dtype != "auto" and self.kv_cache.numel() > 0

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype,
                       enable_prefix_caching: bool) -> dict[str, KVCacheSpec]:
        specs = {"kv_cache": MLAAttentionSpec(block_size, self.stored_dtype(dtype),
                                              self.kv_lora_rank + self.qk_rope_head_dim)}
        if self.kv_cache_dtype != "auto":
            specs["kv_scale"] = KVScaleSpec(block_size, torch.float32, 1)
        return specs

    @property
    def kv_b_proj(self) -> Linear:
        return self._kv_b_proj[0]

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, latent], W_UV^T [H, latent, v]) from kv_b_proj, made once
        (the weights are fixed after loading)."""
        if self._absorbed is None:
            w = self.kv_b_proj.weight.detach().view(
                self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
            self._absorbed = (w[:, :self.qk_nope_head_dim].contiguous(),
                              w[:, self.qk_nope_head_dim:].transpose(1, 2).contiguous())
        return self._absorbed

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                sparse: SparseSelection | None = None, win: RowWindow | None = None) -> torch.Tensor:
        """q_nope [R, H, nope], q_pe [R, H, rope] (roped) for the R rows attended: every row of
        the step, or under DSA context parallelism (``win``) this rank's; latent [T, kv_lora_rank]
        (normalised), k_pe [T, rope] (roped) for every row -> [R, H * v_head_dim]"""
        md: PagedAttentionMetadata = self.attn_metadata("kv_cache")
        R = q_nope.shape[0]
        entry = torch.cat((latent, k_pe), dim=-1)  # what one token keeps
        if self.kv_cache.numel():  # step 24: latents into their slots
            self.write_rows(self.kv_cache, self.kv_scale, md.slot_mapping, entry)
        mark = tracing.forward_mark()
        mark(Step.OPS_KV_WRITE)
        out = q_nope.new_empty(R, q_nope.shape[1], self.v_head_dim)
        lo, nd = win.lo if win is not None else 0, md.num_decodes
        a, b = (0, nd) if win is None else win.clip(0, nd)
        if b > a:
            topk = None if sparse is None or sparse.decode_topk is None else (sparse.decode_topk, sparse.decode_valid)
            out[a - lo:b - lo] = self._decode(q_nope[a - lo:b - lo], q_pe[a - lo:b - lo],
                                              md.decode_block_tables[a:b], md.decode_context_lens[a:b], topk)
        for i, span in enumerate(md.prefills):
            s, e = span.query_start, span.query_end
            a, b = (s, e) if win is None else win.clip(s, e)
            if a == b:
                continue
            rows, mask = slice(a - lo, b - lo), sparse.prefill_masks[i] if sparse is not None else None
            if self.c8:  # each row as a decode row over the 8-bit cache
                out[rows] = self._prefill_rows_8bit(q_nope[rows], q_pe[rows], span, a - s, mask)
            elif win is None:  # the chunk, expanded through kv_b_proj
                out[rows] = self._prefill(q_nope[rows], q_pe[rows], entry[s:e], span, mask)
            else:  # this rank's rows, every head, absorbed
                out[rows] = self._prefill_rows(q_nope[rows], q_pe[rows], entry[s:b], span, a - s, mask)
        mark(Step.OPS_ATTENTION)
        return out.view(R, -1)

    def _prefill_rows_8bit(self, q_nope, q_pe, span: PrefillSpan, first: int, sparse_mask) -> torch.Tensor:
        """C8: rows [first, first + n) of a prefill chunk, each attended as a decode row at its
        position over the 8-bit latent cache (the indexer's chosen tokens only, with a mask)."""
        n = q_nope.shape[0]
        p0 = span.num_computed + first
        lens = torch.arange(p0 + 1, p0 + n + 1, dtype=torch.int32)
        topk = None
        if sparse_mask is not None:  # the chosen positions of each row, as the indexer's decode top-k
            vals, pos = sparse_mask.float().topk(int(sparse_mask.sum(-1).max()), dim=-1)
            topk = (pos, vals > 0)
        return self._decode(q_nope, q_pe, span.block_ids.expand(n, -1), lens, topk)

    def _prefill_rows(self, q_nope, q_pe, entry, span: PrefillSpan, first: int, sparse_mask) -> torch.Tensor:
        """Rows [first, first + n) of prefill chunk ``span``, every head, in the absorbed form
        against the latent of the tokens they may see (DSA context parallelism)."""
        n, H = q_nope.shape[:2]
        total = span.num_computed + first + n  # the context of the last row
        ctx = gather_blocks(self.kv_cache, span.block_ids)[0, :total] if self.kv_cache.numel() else entry
        mark_context_gathered(cp_context_tokens=total)
        w_uk, w_uv_t = self.absorbed_weights()
        q = torch.cat((torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1), q_pe), dim=-1)  # [n, H, latent + rope]
        if sparse_mask is not None:
            allowed = sparse_mask[:, :total]  # already causal
        else:
            allowed = torch.arange(total)[None, :] <= torch.arange(total - n, total)[:, None]
        o_lat = q.new_empty(n, H, self.kv_lora_rank)
        step = max(1, (1 << 24) // (H * total))  # bounds the [rows, H, context] scores
        for r in range(0, n, step):
            sc = torch.matmul(q[r:r + step], ctx.transpose(0, 1)).float() * self.scale  # [rows, H, total]
            sc.masked_fill_(~allowed[r:r + step, None, :], float("-inf"))
            o_lat[r:r + step] = torch.matmul(torch.softmax(sc, dim=-1).to(q.dtype), ctx[:, :self.kv_lora_rank])
        return torch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1)  # [n, H, v]

    def _prefill(self, q_nope, q_pe, entry, span: PrefillSpan, sparse_mask) -> torch.Tensor:
        # Not the paged prefill kernel: it would need the absorbed form (one latent KV head of
        # width latent + rope), whose attention costs ~3x the expanded form's for every query;
        # here the gather copies only the latent, and expanding it through kv_b_proj dominates.
        n, H = q_nope.shape[0], self.num_heads
        total = span.num_computed + n
        ctx = gather_blocks(self.kv_cache, span.block_ids)[0, :total] if self.kv_cache.numel() else entry
        kv = self.kv_b_proj(ctx[:, :self.kv_lora_rank]).view(total, H, -1)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat((k_nope, ctx[:, None, self.kv_lora_rank:].expand(total, H, self.qk_rope_head_dim)), -1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        mask, causal = None, True
        if sparse_mask is not None:
            mask, causal = sparse_mask, False  # already causal
        elif span.num_computed:
            mask = torch.arange(total)[None, :] <= torch.arange(span.num_computed, total)[:, None]
            causal = False
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=mask, is_causal=causal,
                                           scale=self.scale)
        return o[0].transpose(0, 1)

    def _decode(self, q_nope, q_pe, tables, context_lens, topk) -> torch.Tensor:
        """Decode rows in the absorbed form; ``topk``: the indexer's (positions, valid) per row."""
        w_uk, w_uv_t = self.absorbed_weights()
        if q_nope.shape[1] < self.num_heads:  # this rank's heads of a whole kv_b_proj
            h = slice(self.head_offset, self.head_offset + q_nope.shape[1])
            w_uk, w_uv_t = w_uk[h], w_uv_t[h]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, latent]
        q = torch.cat((q_lat, q_pe), dim=-1).contiguous()
        kc = self.kv_cache
        if topk is not None:
            bs = kc.shape[2]
            pos, valid = topk
            blocks = tables.gather(1, pos // bs)
            # [B, k, latent + rope]: only the chosen tokens (dequantized under C8)
            sel = self.read_rows(kc, self.kv_scale, blocks * bs + pos % bs).to(q.dtype)
            s = torch.bmm(q, sel.transpose(1, 2)).float() * self.scale  # [B, H, k]
            s.masked_fill_(~valid[:, None, :], float("-inf"))
            o_lat = torch.bmm(torch.softmax(s, dim=-1).to(q.dtype), sel[..., :self.kv_lora_rank])
        elif self.c8:  # the same over the 8-bit cache, each row dequantized as the kernel reads it
            ks = self.kv_scale
            attend = cpu_kernels.decode_attention_8bit if cpu_kernels.usable(q) else attention_8bit_torch
            o_lat = attend(q, kc, kc, ks, ks, tables, context_lens, self.scale, self.fp8_cache)[..., :self.kv_lora_rank]
        else:  # MQA over the cache as it is: K = the whole entry, V = its latent part
            args = (q, kc, kc, tables, context_lens, self.scale)
            o = cpu_kernels.decode_attention(*args) if cpu_kernels.usable(q) else decode_attention_torch(*args)
            o_lat = o[..., :self.kv_lora_rank]
        return torch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1)  # [B, H, v]

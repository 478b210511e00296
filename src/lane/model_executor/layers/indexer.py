"""DeepSeek Sparse Attention's lightning indexer (seed step 25).

For every query token it scores all of that request's earlier tokens,
``score[t] = sum_h w_h * relu(q_h . k_t) / sqrt(d)``, with its own small query
heads (from the q LoRA), one shared key per token (``wk`` + LayerNorm, kept in
its own paged cache next to the MLA latent), and per-head weights from the
hidden state. Attention then covers only the top ``index_topk`` tokens. When a
query's causal context is no longer than ``index_topk`` every token is selected,
so the result equals dense MLA.

The reference rotates with a Hadamard transform and scores in FP8; the
transform is orthogonal (dot products unchanged), so, as transformers does, the
scores are computed directly, in float32.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from lane import tracing
from lane.distributed.parallel_state import dsa_head_group
from lane.tracing import Step
from lane.attention.metadata import PagedAttentionMetadata
from lane.kv_cache_interface import IndexerKeySpec, KVCacheSpec, KVScaleSpec
from lane.model_executor.layers.attention import CacheLayer, dequantize_8bit, gather_blocks
from lane.model_executor.layers.context_parallel import RowWindow
from lane.model_executor.layers.linear import Linear
from lane.model_executor.layers.parallel_linear import ColumnParallelLinear
from lane.model_executor.layers.rotary_embedding import RotaryEmbedding, rope_rows

_SCORE_CHUNK_ELEMS = 1 << 26  # bounds a prefill chunk's [rows, heads, context] score tensor


@dataclass
class SparseSelection:
    """Which cached tokens each query row may attend to; None where it is all of them."""
    decode_topk: torch.Tensor | None = None  # [num_decodes, k] token positions
    decode_valid: torch.Tensor | None = None  # [num_decodes, k] False where the context was shorter
    prefill_masks: list[torch.Tensor | None] = field(default_factory=list)  # per chunk: [n, total] bool
    # (the rows are those attended: all, or under DSA context parallelism this rank's)


class SharedTopk:
    """GLM-5's cross-layer top-k sharing (``indexer_types``): a "full" layer's indexer choice,
    which the "shared" layers after it attend with, within one forward (they have no indexer)."""
    selection: SparseSelection | None = None


class Indexer(CacheLayer):
    decode_rows_independent = True
    supports_8bit_cache = True  # C8's li_c8: the keys a byte a value, a scale per token

    def __init__(self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, topk: int,
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        # split by heads over tensor-parallel ranks: each scores with its heads, the scores are
        # summed (an all-reduce) before the top-k; the one shared key per token is whole on every rank.
        # Under DSA context parallelism every rank holds every head and scores its rows only
        self.tp = dsa_head_group()
        self.n_heads = n_heads // self.tp.world_size
        self.head_scale = n_heads ** -0.5  # over all heads
        self.head_dim = head_dim
        self.topk = topk
        self.softmax_scale = head_dim ** -0.5
        self.wq_b = ColumnParallelLinear(q_lora_rank, n_heads * head_dim, bias=False, tp=self.tp)
        self.wk = Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        # float32 as in the reference (it steers a discrete choice)
        self.weights_proj = ColumnParallelLinear(hidden_size, n_heads, bias=False, dtype=torch.float32, tp=self.tp)
        self._rotary = (rotary,)  # shared with the model, not a submodule of this one
        self.k_cache = torch.empty(0)
        self.k_scale = torch.empty(0)

    def kv_cache_specs(self, block_size: int, dtype: torch.dtype,
                       enable_prefix_caching: bool) -> dict[str, KVCacheSpec]:
        specs = {"k_cache": IndexerKeySpec(block_size, self.stored_dtype(dtype), self.head_dim)}
        if self.kv_cache_dtype != "auto":
            specs["k_scale"] = KVScaleSpec(block_size, torch.float32, 1)
        return specs

    def _keys(self, tables: torch.Tensor) -> torch.Tensor:
        """[..., n] block ids -> the keys of those blocks [..., n * block_size, d], dequantized from
        the 8-bit cache under C8 (a pass of blocks at a time: _scores_over)."""
        keys = gather_blocks(self.k_cache, tables)[..., 0, :, :]
        if self.kv_cache_dtype == "auto":
            return keys
        scales = gather_blocks(self.k_scale[..., None], tables)[..., 0, :, 0]
        return dequantize_8bit(keys, scales, self.fp8_cache)

    def forward(self, rope, x: torch.Tensor, q_resid: torch.Tensor, win: RowWindow | None = None
                ) -> SparseSelection:
        """x [T, hidden] (the layer's normed input), q_resid [T, q_lora_rank]. Every row's key
        goes into the cache; the choices are made for every row, or under DSA context
        parallelism (``win``) for this rank's rows only, which are then the selection's rows."""
        md: PagedAttentionMetadata = self.attn_metadata("k_cache")
        T = x.shape[0]
        lo, hi = (win.lo, win.hi) if win is not None else (0, T)
        rot = self._rotary[0]  # half-split rope on the first rope dims
        q = rot.rotate(rope_rows(rope, lo, hi), self.wq_b(q_resid[lo:hi]).view(hi - lo, self.n_heads, self.head_dim))
        k = rot.rotate(rope, self.k_norm(self.wk(x)).view(T, 1, self.head_dim)).view(T, self.head_dim)
        kc = self.k_cache
        if kc.numel():
            self.write_rows(kc, self.k_scale, md.slot_mapping, k)
        weights = self.weights_proj(x[lo:hi].float()) * self.head_scale  # [rows, H]
        sel = SparseSelection()
        a, b = min(lo, md.num_decodes), min(hi, md.num_decodes)  # this rank's decode rows
        if b > a and int(md.decode_context_lens[a:b].max()) > self.topk:
            tables = md.decode_block_tables[a:b]
            scores = self._scores_over(q[a - lo:b - lo], weights[a - lo:b - lo], tables,
                                       tables.shape[1] * kc.shape[2])  # [B, L]
            pad = torch.arange(scores.shape[1])[None, :] >= md.decode_context_lens[a:b].long()[:, None]
            top = scores.masked_fill_(pad, float("-inf")).topk(self.topk, dim=-1)
            sel.decode_topk, sel.decode_valid = top.indices, top.values > float("-inf")
        for span in md.prefills:
            s, e = span.query_start, span.query_end
            a, b = (s, e) if win is None else win.clip(s, e)
            total = span.num_computed + (e - s)
            if total <= self.topk or a == b:
                sel.prefill_masks.append(None)
                continue
            causal = torch.arange(total)[None, :] <= torch.arange(span.num_computed, total)[a - s:b - s, None]
            scores = torch.cat([self._scores_over(q[r - lo:r - lo + n], weights[r - lo:r - lo + n], span.block_ids,
                                                  total) if kc.numel()
                                else self._scores(q[r - lo:r - lo + n], weights[r - lo:r - lo + n], k[s:e])
                                for r, n in self._row_chunks(a, b, total)])
            top = scores.masked_fill_(~causal, float("-inf")).topk(self.topk, dim=-1).indices
            sel.prefill_masks.append(torch.zeros_like(causal).scatter_(1, top, True) & causal)
        tracing.forward_mark()(Step.MODEL_INDEXER_TOPK)
        return sel

    def _scores_over(self, q: torch.Tensor, weights: torch.Tensor, tables: torch.Tensor, total: int) -> torch.Tensor:
        """Index scores [R, total] against the cached keys of ``tables`` (one request's [n], or a
        table per row [R, n]): the gathered keys at once, or under C8 in passes of c8_pass_blocks
        blocks, each pass's keys dequantized alone (never a copy of the whole context's). The
        sum over heads is linear, so passes reduce over ranks as the whole would."""
        n_blocks = min(tables.shape[-1], -(-total // self.k_cache.shape[2]))
        parts = [self._scores(q, weights, self._keys(tables[..., j:k])) for j, k in self.c8_passes(n_blocks)]
        return torch.cat(parts, dim=-1)[..., :total]

    def _row_chunks(self, start: int, end: int, total: int):
        rows = max(1, _SCORE_CHUNK_ELEMS // (self.n_heads * total))
        return [(r, min(rows, end - r)) for r in range(start, end, rows)]

    def _scores(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """q [R, H, D], weights [R, H], keys [L, D] or [R, L, D] -> index scores [R, L]"""
        s = torch.relu(torch.matmul(q.float(), keys.float().transpose(-1, -2)) * self.softmax_scale)  # [R, H, L]
        return self.tp.all_reduce(torch.matmul(weights.unsqueeze(-2), s).squeeze(-2).contiguous(),
                                  Step.MODEL_INDEXER_TOPK)

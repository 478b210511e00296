"""DeepSeek V4 (``DeepseekV4ForCausalLM``), checked against transformers' reference.

Per layer: mHC hyper-connections (``hc_mult`` residual streams, Sinkhorn-normalised
mixing) around attention and the MoE. Attention is shared-KV MQA (one K = V head,
RMSNormed, rope on the last channels as interleaved pairs, the output de-rotated),
with per-head sinks and a grouped low-rank output projection. Its keys are a
sliding window of raw tokens plus, by layer type, compressed entries: all visible
ones (HCA, non-overlapping windows) or the lightning indexer's top-k (CSA,
overlapping windows). The cache and the pooling live in
``layers/compressed_attention.py``. MoE: ``sqrtsoftplus`` scores, a selection-only
bias, hash layers routed by ``tid2eid[token]``, a clamped SwiGLU.

Modules are named as the released checkpoints name their tensors (``attn.wq_a``,
``ffn.experts.3.w1``, ``hc_attn_fn``...); transformers-style names are mapped to them.
"""
from __future__ import annotations

import logging
import re
from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

from lane import platform, tracing
from lane.distributed.parallel_state import (dsa_context_parallel, dsa_head_group, get_tp_group,
                                            replica_local_experts, sequence_parallel_begin)
from lane.model_executor.layers.context_parallel import (heads_to_rows, mark_context_gathered, row_window,
                                                         rows_to_heads)
from lane.tracing import Step
from lane.model_executor.layers.compressed_attention import (V4AttentionCache, V4RMSNorm, attend_with_sinks,
                                                             rope_tail, unweighted_rms_norm)
from lane.model_executor.layers.fused_moe import FusedMoE, combine_routed, fused_expert_name, share_rows
from lane.model_executor.models.deepseek_v2 import drop_unloaded_mtp
from lane.model_executor.layers import cpu_kernels
from lane.model_executor.layers.linear import Linear, linear
from lane.model_executor.loader.safetensors_loader import materialize
from lane.model_executor.layers.parallel_linear import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                                        VocabParallelEmbedding, gather_rows, own_rows, reduce_partial,
                                                        shard_param)

logger = logging.getLogger(__name__)

SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


class V4Rope:
    """The two rope settings: "main" (sliding layers) and "compress" (CSA / HCA layers,
    their compressors and indexers), as inverse frequencies over the rope pairs."""

    def __init__(self, config) -> None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        self.inv_freq, self.scaling = {}, {}
        for kind, params in config.rope_parameters.items():
            if not isinstance(params, dict):
                continue
            rope_type = params.get("rope_type", "default")
            if rope_type == "default":
                dim = int(config.head_dim * params.get("partial_rotary_factor", 1.0))
                inv = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
                scaling = 1.0
            else:
                inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, layer_type=kind)
            self.inv_freq[kind], self.scaling[kind] = inv.float(), float(scaling)

    def cos_sin(self, kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[kind]
        return freqs.cos() * self.scaling[kind], freqs.sin() * self.scaling[kind]


class Compressor(nn.Module):
    """kv / gate projections and position bias of one pooled series (x2 with overlap)."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = dim * (2 if overlap else 1)
        self.rate, self.overlap = rate, overlap
        self.wkv = Linear(hidden, width, bias=False, dtype=torch.float32)
        self.wgate = Linear(hidden, width, bias=False, dtype=torch.float32)
        self.ape = nn.Parameter(torch.zeros(rate, width, dtype=torch.float32))
        self.norm = V4RMSNorm(dim, eps)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.float()
        return self.wkv(x), self.wgate(x) + self.ape[positions % self.rate]


class CSAIndexer(nn.Module):
    """CSA's lightning indexer: its own compressor over the same windows, query
    heads from the q LoRA, and per-head weights."""

    def __init__(self, config, rate: int) -> None:
        super().__init__()
        # split by heads: the ranks' scores are summed before the top-k (every head on every rank
        # under DSA context parallelism, which splits a prefill step's rows instead)
        self.tp = dsa_head_group()
        self.n_heads = config.index_n_heads // self.tp.world_size
        self.head_scale = config.index_n_heads ** -0.5
        self.head_dim, self.topk = config.index_head_dim, config.index_topk
        self.wq_b = ColumnParallelLinear(config.q_lora_rank, config.index_n_heads * self.head_dim, bias=False,
                                         tp=self.tp)
        self.weights_proj = ColumnParallelLinear(config.hidden_size, config.index_n_heads, bias=False,
                                                 dtype=torch.float32, tp=self.tp)
        self.compressor = Compressor(config.hidden_size, self.head_dim, rate, True, config.rms_norm_eps)


class DeepseekV4Attention(nn.Module):
    def __init__(self, config, layer_idx: int, rope: V4Rope, layer_type: str | None = None) -> None:
        super().__init__()
        self.layer_type = layer_type or config.layer_types[layer_idx]
        self.rope_kind = "main" if self.layer_type == SWA else "compress"
        # tensor parallel: query heads and output groups split by rank; the one K = V head, its
        # window and compressed entries, are whole on every rank
        n = get_tp_group().world_size
        H_all, G_all = config.num_attention_heads, config.o_groups
        H, d = self.num_heads, self.head_dim = H_all // n, config.head_dim
        self.window = config.sliding_window
        self.eps = config.rms_norm_eps
        self.o_groups = G_all // n
        self.wq_a = Linear(config.hidden_size, config.q_lora_rank, bias=False)
        self.q_norm = V4RMSNorm(config.q_lora_rank, self.eps)
        self.wq_b = ColumnParallelLinear(config.q_lora_rank, H_all * d, bias=False)
        self.wkv = Linear(config.hidden_size, d, bias=False)
        self.norm = V4RMSNorm(d, self.eps)
        # read as grouped matrices (torch.bmm in forward): stays as loaded; a rank holds whole groups
        self.wo_a = ColumnParallelLinear(H_all * d // G_all, G_all * config.o_lora_rank, bias=False,
                                         quantizable=False)
        self.wo_b = RowParallelLinear(G_all * config.o_lora_rank, config.hidden_size, bias=False)
        rate = config.compress_rates[self.layer_type] if self.layer_type != SWA else 0
        # DSA context parallelism (CSA layers): a prefill step's rows split over the ranks, each
        # attending its rows with every head, so every head's sink is on every rank
        self.context_parallel = self.layer_type == CSA and dsa_context_parallel()
        self.head_offset = H * get_tp_group().rank_in_group
        self.attn_sink = nn.Parameter(torch.zeros(H_all if self.context_parallel else H, dtype=torch.float32))
        self.compressor = (Compressor(config.hidden_size, d, rate, self.layer_type == CSA, self.eps)
                           if rate else None)
        self.indexer = CSAIndexer(config, rate) if self.layer_type == CSA else None
        cache_cls = platform.select_attention_backend(config).backend.get_impl_cls()  # compressed
        self.cache: V4AttentionCache = cache_cls(self.layer_type, d, self.window, rate, config.index_head_dim)
        self._rope = (rope,)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        T, H, d = x.shape[0], self.num_heads, self.head_dim
        cache = self.cache
        md = cache.metadata()
        cos, sin = self._rope[0].cos_sin(self.rope_kind, positions)
        q_res = self.q_norm(self.wq_a(x))
        q = rope_tail(unweighted_rms_norm(self.wq_b(q_res).view(T, H, d), self.eps), cos[:, None], sin[:, None])
        kv = rope_tail(self.norm(self.wkv(x)), cos, sin)
        mark = tracing.forward_mark()
        lt = {"layer_type": self.layer_type}
        mark(Step.MODEL_QKV_PROJ, **lt)
        cache.write_window(kv, md)
        mark(Step.OPS_KV_WRITE, **lt)
        nd = md.window.num_decodes
        win = row_window(T, bool(md.window.prefills)) if self.context_parallel else None
        qa, lo = (q, 0) if win is None else (heads_to_rows(q, win), win.lo)  # the rows this rank attends
        out = torch.empty_like(qa)
        if nd:  # decodes: one batched pass
            a, b = (0, nd) if win is None else win.clip(0, nd)
            out[a - lo:b - lo] = self._decode(x[:nd], qa[a - lo:b - lo], q_res[:nd], positions[:nd], md, mark, lt,
                                              a, b)
        for i, span in enumerate(md.window.prefills):  # prefill chunks: one request at a time
            s, e = span.query_start, span.query_end
            a, b = (s, e) if win is None else win.clip(s, e)
            out[a - lo:b - lo] = self._prefill(x[s:e], qa[a - lo:b - lo], q_res[s:e], positions[s:e], md, i,
                                               mark, lt, a - s, b - s)
        if win is not None:
            out = rows_to_heads(out, win)
        out = rope_tail(out, cos[:, None], -sin[:, None])  # V carried rope: undo it at the query position
        g = self.o_groups
        w = self.wo_a.weight.view(g, -1, H * d // g)
        grouped = torch.bmm(out.reshape(T, g, -1).transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)
        out = self.wo_b(grouped.reshape(T, -1))
        mark(Step.COMM_ATTN_REDUCE, **lt)
        return out

    def _sinks(self, heads: int) -> torch.Tensor:
        """The sinks of a query's heads: every head's, or this rank's of every head's (a decode
        split by heads under DSA context parallelism)."""
        if heads == self.attn_sink.shape[0]:
            return self.attn_sink
        return self.attn_sink[self.head_offset:self.head_offset + heads]

    def _prefill(self, x, q, q_res, pos, md, i, mark, lt, a: int, b: int) -> torch.Tensor:
        """Prefill chunk i (one request): fold it into the running state (emitting the
        entries of the windows it completes), then attention over [window ; entries] for its
        rows [a, b) (all of them, or this rank's under DSA context parallelism); q: those rows'."""
        cache, n = self.cache, x.shape[0]
        p0 = md.window.prefills[i].num_computed
        n_entries = 0
        if self.compressor is not None:  # step 23: this chunk's windows into entries
            n_entries = self._compress(self.compressor, "state", x, pos, md, i)
            if self.indexer is not None:
                self._compress(self.indexer.compressor, "index_state", x, pos, md, i)
            mark(Step.MODEL_QKV_PROJ, **lt)
        if a == b:
            return q
        first = max(0, p0 - self.window + 1)
        keys = cache.window_keys(md.window.prefills[i].block_ids, first, p0 + n - 1)
        kpos, rows = torch.arange(first, p0 + n), pos[a:b]
        parts = [(keys, (kpos[None, :] <= rows[:, None]) & (kpos[None, :] > rows[:, None] - self.window))]
        if n_entries:
            table, windows = md.entries.prefills[i].block_ids, torch.arange(n_entries)
            visible = windows[None, :] < ((rows + 1) // self.compressor.rate)[:, None]
            if self.indexer is not None:  # step 25: top-k entries per query
                visible &= self._select(x[a:b], q_res[a:b], rows, table, windows, visible)
                mark(Step.MODEL_INDEXER_TOPK, **lt)
            parts += [(cache.entries("state", table, windows[j:k]), visible[:, j:k])
                      for j, k in cache.entry_passes(n_entries)]
        if q.shape[1] > self.num_heads:
            mark_context_gathered(**lt)
        out = attend_with_sinks(q, parts, self._sinks(q.shape[1]), self.head_dim ** -0.5)
        mark(Step.OPS_ATTENTION, **lt)
        return out

    def _decode(self, x, q, q_res, pos, md, mark, lt, a: int, b: int) -> torch.Tensor:
        """All decode rows at once: one token each folds into its request's running state
        (closing a window emits an entry), then attention over [window ; entries] for rows
        [a, b) (all, or this rank's under DSA context parallelism); q: those rows'."""
        cache = self.cache
        B = x.shape[0]
        n_entries = torch.zeros(B, dtype=torch.long)
        if self.compressor is not None:
            n_entries = self._decode_compress(self.compressor, "state", x, pos, md)
            if self.indexer is not None:
                self._decode_compress(self.indexer.compressor, "index_state", x, pos, md)
            mark(Step.MODEL_QKV_PROJ, **lt)
        if a == b:
            return q
        x, q_res, pos, n_entries = x[a:b], q_res[a:b], pos[a:b], n_entries[a:b]
        kpos = pos[:, None] - torch.arange(self.window - 1, -1, -1)[None, :]  # [B, W]: p - W + 1 .. p
        parts = [(cache.decode_window_keys(md.window.decode_block_tables[a:b], kpos.clamp(min=0)), kpos >= 0)]
        E = int(n_entries.max()) if self.compressor is not None else 0
        if E:
            tables = md.entries.decode_block_tables[a:b]
            windows = torch.arange(E).expand(b - a, E)
            visible = windows < n_entries[:, None]
            if self.indexer is not None:
                visible &= self._select(x, q_res, pos, tables, windows, visible)
                mark(Step.MODEL_INDEXER_TOPK, **lt)
            parts += [(cache.entries("state", tables, windows[:, j:k]), visible[:, j:k])
                      for j, k in cache.entry_passes(E)]
        out = attend_with_sinks(q, parts, self._sinks(q.shape[1]), self.head_dim ** -0.5)
        mark(Step.OPS_ATTENTION, **lt)
        return out

    def _entries(self, comp: Compressor, pooled: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        """Pooled windows -> entries: normed, roped at their first position."""
        cos, sin = self._rope[0].cos_sin("compress", windows * comp.rate)
        return rope_tail(comp.norm(pooled), cos, sin)

    def _decode_compress(self, comp: Compressor, which: str, x, pos, md) -> torch.Tensor:
        """One row per request into its state; entries for the windows that close.
        Returns how many entries each request has now."""
        kv, gate = comp.project(x, pos)  # [B, width]
        fold = self.cache.fold_decode(which, kv, gate, pos, comp.overlap, md)
        if fold.rows.numel():
            w = pos[fold.rows] // comp.rate
            entries = self._entries(comp, fold.done[:, 2] / fold.done[:, 1], w)
            self.cache.write_entries(which, md.entries.decode_block_tables[fold.rows], w[:, None], entries)
        return (pos + 1) // comp.rate

    def _compress(self, comp: Compressor, which: str, x, pos, md, i: int) -> int:
        """Fold prefill chunk i into its request's running state, write the entries it
        completes; returns how many entries the request has now."""
        kv, gate = comp.project(x, pos)
        res = self.cache.fold_prefill(which, kv, gate, comp.overlap, md, i)
        if res.pooled.shape[0]:
            windows = torch.arange(res.first_window, res.first_window + res.pooled.shape[0])
            self.cache.write_entries(which, md.entries.prefills[i].block_ids, windows,
                                     self._entries(comp, res.pooled, windows))
        return int(pos[-1] + 1) // comp.rate

    def _select(self, x, q_res, pos, table, windows, visible) -> torch.Tensor:
        """The indexer's top-k visible entries for each query row -> [rows, E] bool, scoring
        the indexer's entries of ``windows`` ([E] in one request's table, or [rows, E] in a
        table per row) a pass at a time (C8: each pass dequantized alone)."""
        idx, n, cache = self.indexer, x.shape[0], self.cache
        cos, sin = self._rope[0].cos_sin("compress", pos)
        q = rope_tail(idx.wq_b(q_res).view(n, idx.n_heads, idx.head_dim), cos[:, None], sin[:, None]).float()
        weights = idx.weights_proj(x.float()) * idx.head_scale  # [rows, H_I]
        scores = []
        for j, k in cache.entry_passes(windows.shape[-1]):
            keys = cache.entries("index_state", table, windows[..., j:k])
            # relu, then the scale, then the weighted sum over heads: the reference's order
            s = torch.relu(torch.matmul(q, keys.float().transpose(-1, -2))) * idx.head_dim ** -0.5
            scores.append(idx.tp.all_reduce((s * weights[..., None]).sum(dim=1).contiguous(), Step.MODEL_INDEXER_TOPK))
        scores = torch.cat(scores, dim=-1)
        top = scores.masked_fill(~visible, float("-inf")).topk(min(idx.topk, visible.shape[1]), dim=-1).indices
        return torch.zeros_like(visible).scatter_(1, top, True)


class HyperConnection(nn.Module):
    """mHC: from the hc_mult streams, weights to collapse them into the sublayer's
    input (pre), to spread its output back (post), and to mix the streams (comb,
    doubly stochastic by Sinkhorn). float32 throughout."""

    def __init__(self, hc: int, hidden: int, iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc, self.iters, self.hc_eps, self.norm_eps = hc, iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + hc) * hc, hc * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + hc) * hc, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor):
        """streams [T, hc, D] -> post [T, hc], comb [T, hc, hc], collapsed [T, D]"""
        hc = self.hc
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mix = linear(flat, self.fn)
        pre_w, post_w, comb_w = mix.split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, hc, hc) * self.scale[2] + comb_b.view(hc, hc), dim=-1) + self.hc_eps
        if cpu_kernels.usable(comb):  # ~80 tiny ops in torch: one call
            cpu_kernels.sinkhorn_(comb, self.iters, self.hc_eps)
        else:
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
            for _ in range(self.iters - 1):
                comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
                comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def hc_apply(streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """New streams: post_k * y + sum_j comb[j, k] * stream_j."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HyperHead(nn.Module):
    def __init__(self, hc: int, hidden: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc, hc * hidden, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(hc, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        pre = torch.sigmoid(linear(flat, self.hc_fn) * self.hc_scale + self.hc_base) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class V4Gate(nn.Module):
    def __init__(self, config, hashed: bool) -> None:
        super().__init__()
        E, k = config.n_routed_experts, config.num_experts_per_tok
        self.top_k, self.hashed = k, hashed
        self.scoring_func = config.scoring_func
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(E, config.hidden_size))
        if hashed:  # frozen token -> experts table
            self.tid2eid = nn.Parameter(torch.zeros(config.vocab_size, k, dtype=torch.long), requires_grad=False)
        else:  # steers the choice only
            self.bias = nn.Parameter(torch.zeros(E, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        if self.scoring_func == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.scoring_func == "sigmoid":
            scores = logits.sigmoid()
        else:
            raise ValueError(f"unsupported scoring_func {self.scoring_func!r}")
        if self.hashed:
            ids = self.tid2eid[input_ids]
        else:
            ids = torch.topk(scores + self.bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class SharedExpert(nn.Module):
    """Split by rank like a dense MLP; its partial sum is reduced with the routed experts'."""

    def __init__(self, hidden: int, inter: int, limit: float) -> None:
        super().__init__()
        self.w1 = ColumnParallelLinear(hidden, inter, bias=False)
        self.w3 = ColumnParallelLinear(hidden, inter, bias=False)
        self.w2 = RowParallelLinear(inter, hidden, bias=False, reduce=False)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(F.silu(gate) * up)


class V4MoE(nn.Module):
    def __init__(self, config, layer_idx: int, hashed: bool | None = None) -> None:
        super().__init__()
        hashed = config.mlp_layer_types[layer_idx] == "hash_moe" if hashed is None else hashed
        self.gate = V4Gate(config, hashed)
        inter = config.moe_intermediate_size
        self.experts = FusedMoE(config.n_routed_experts, config.num_experts_per_tok, config.hidden_size, inter,
                                swiglu_limit=config.swiglu_limit)
        self.shared_experts = SharedExpert(config.hidden_size, inter, config.swiglu_limit)
        self.tp = get_tp_group()

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        if self.experts.all_to_all:  # each token routed once, by its own rank (FusedMoE.all_to_all)
            mine = share_rows(self.tp, x)
            weights, ids = self.gate(mine, share_rows(self.tp, input_ids))
            tracing.forward_mark()(Step.MODEL_MOE_ROUTE, routing="hash" if self.gate.hashed else "learned")
            routed = self.experts.forward_all_to_all(mine, weights, ids)
            return combine_routed(self.tp, routed, self.shared_experts(x), x.shape[0])
        weights, ids = self.gate(x, input_ids)
        tracing.forward_mark()(Step.MODEL_MOE_ROUTE, routing="hash" if self.gate.hashed else "learned")
        out = self.experts(x, weights, ids) + self.shared_experts(x)
        return reduce_partial(self.tp, out, Step.COMM_FFN_REDUCE, compute_step=Step.OPS_FFN)


class DeepseekV4Block(nn.Module):
    def __init__(self, config, layer_idx: int, rope: V4Rope, mtp: bool = False) -> None:
        super().__init__()
        hc, D = config.hc_mult, config.hidden_size
        # the MTP block: sliding-window attention only, learned routing
        self.attn = DeepseekV4Attention(config, layer_idx, rope, SWA if mtp else None)
        self.ffn = V4MoE(config, layer_idx, False if mtp else None)
        self.attn_norm = V4RMSNorm(D, config.rms_norm_eps)
        self.ffn_norm = V4RMSNorm(D, config.rms_norm_eps)
        for part in ("attn", "ffn"):
            h = HyperConnection(hc, D, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps)
            setattr(self, f"hc_{part}", h)

    def forward(self, streams: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """streams: the rows this rank holds (its own under sequence parallelism: mHC and the
        norms run on them, attention and the FFN gather every row first)."""
        mark = tracing.forward_mark()
        post, comb, x = self.hc_attn(streams)
        x = gather_rows(self.attn_norm(x), Step.OPS_INPUT_NORM)
        mark(Step.OPS_INPUT_NORM)
        streams = hc_apply(streams, post, comb, self.attn(x, positions))
        post, comb, x = self.hc_ffn(streams)
        x = gather_rows(self.ffn_norm(x), Step.OPS_INPUT_NORM)
        mark(Step.OPS_INPUT_NORM)
        streams = hc_apply(streams, post, comb, self.ffn(x, input_ids))
        mark(Step.OPS_FFN)
        return streams


class DeepseekV4MTPLayer(DeepseekV4Block):
    """``mtp.{i}``: to draft x_{t+2}, the main model's last streams X_t and the token x_{t+1}:
    e_proj(enorm(emb)) broadcast to the streams + h_proj(hnorm(X_t)) per stream, one block,
    then its own hc_head and norm before the shared head."""

    def __init__(self, config, layer_idx: int, rope: V4Rope) -> None:
        super().__init__(config, layer_idx, rope, mtp=True)
        D = config.hidden_size
        self.e_proj = Linear(D, D, bias=False)
        self.h_proj = Linear(D, D, bias=False)
        self.enorm = V4RMSNorm(D, config.rms_norm_eps)
        self.hnorm = V4RMSNorm(D, config.rms_norm_eps)
        self.norm = V4RMSNorm(D, config.rms_norm_eps)
        self.hc_head = HyperHead(config.hc_mult, D, config.hc_eps, config.rms_norm_eps)


# transformers' names -> the released checkpoint's (what lane's modules are called)
_HF_NAMES = [(r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
             (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
             (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
             (r"\.self_attn\.", ".attn."), (r"\.mlp\.", ".ffn."), (r"\.input_layernorm\.", ".attn_norm."),
             (r"\.post_attention_layernorm\.", ".ffn_norm."), (r"\.attn_hc\.", ".hc_attn."), (r"\.ffn_hc\.", ".hc_ffn."),
             (r"\.sinks$", ".attn_sink"), (r"\.kv_norm\.", ".norm."), (r"\.position_bias$", ".ape"),
             (r"\.q_a_proj\.", ".wq_a."), (r"\.q_a_norm\.", ".q_norm."), (r"\.q_b_proj\.", ".wq_b."),
             (r"\.kv_proj\.", ".wkv."), (r"\.gate_proj\.", ".wgate."), (r"\.o_a_proj\.", ".wo_a."),
             (r"\.o_b_proj\.", ".wo_b."), (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
             (r"\.shared_experts\.wgate\.", ".shared_experts.w1."), (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
             (r"\.shared_experts\.down_proj\.", ".shared_experts.w2.")]
_TOP = {"embed.weight": "embed_tokens.weight", "lm_head.weight": "head.weight", "hc_head_fn": "hc_head.hc_fn",
        "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}
_EXPERT = re.compile(r"((?:layers|mtp)\.\d+\.ffn\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")


def canonical_name(name: str) -> str:
    name = name.removeprefix("model.")
    name = _TOP.get(name, name)
    name = re.sub(r"^(mtp\.\d+)\.hc_head_(fn|base|scale)$", r"\1.hc_head.hc_\2", name)
    if ".self_attn." in name or ".mlp." in name or "_layernorm." in name or "_hc." in name:
        for pattern, repl in _HF_NAMES:
            name = re.sub(pattern, repl, name)
    return re.sub(r"\.hc_(attn|ffn)_(fn|base|scale)$", r".hc_\1.\2", name)


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, config, max_position: int | None = None) -> None:
        super().__init__()
        self.config = config
        rope = V4Rope(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekV4Block(config, i, rope) for i in range(config.num_hidden_layers))
        self.hc_head = HyperHead(config.hc_mult, config.hidden_size, config.hc_eps, config.rms_norm_eps)
        self.norm = V4RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = ParallelLMHead(config.hidden_size, config.vocab_size)
        n_mtp = getattr(config, "num_nextn_predict_layers", 0) or 0
        with replica_local_experts():
            self.mtp = nn.ModuleList(DeepseekV4MTPLayer(config, config.num_hidden_layers + i, rope)
                                     for i in range(n_mtp))
        # the MTP block runs only to draft (speculative decoding, which then gives it a cache)
        self.kv_cache_skip = ("mtp.",)
        self.keep_streams = False  # set when MTP drafts: the last forward's streams stay for it
        self._streams: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        sequence_parallel_begin(input_ids.shape[0])
        x = self.embed_tokens(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, positions, input_ids)
        if self.keep_streams:
            self._streams = gather_rows(streams)
        out = gather_rows(self.norm(self.hc_head(streams)), Step.MODEL_LM_HEAD)
        tracing.forward_mark()(Step.MODEL_LM_HEAD)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    def moe_layers(self) -> dict[int, FusedMoE]:
        return {i: layer.ffn.experts for i, layer in enumerate(self.layers)}

    # -- MTP drafting (speculative decoding) ----------------------------------------
    @property
    def num_mtp_layers(self) -> int:
        return len(self.mtp)

    def mtp_source(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the MTP block reads of the main model: the last layer's streams [T, n, D]
        (before hc_head), of the forward that made ``hidden``."""
        return self._streams

    def mtp_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, source: torch.Tensor,
                    i: int = 0) -> torch.Tensor:
        """MTP block i at positions t, from streams X_t and tokens x_{t+1} -> its streams."""
        layer = self.mtp[i]
        sequence_parallel_begin(input_ids.shape[0])
        e = layer.e_proj(layer.enorm(self.embed_tokens(input_ids)))  # this rank's rows under sequence parallelism
        streams = e.unsqueeze(1) + layer.h_proj(layer.hnorm(own_rows(source)))
        return gather_rows(layer(streams, positions, input_ids))

    def mtp_logits(self, streams: torch.Tensor, i: int = 0) -> torch.Tensor:
        layer = self.mtp[i]
        return self.head(layer.norm(layer.hc_head(streams)))

    def finish_loading(self, loaded: set[str]) -> None:
        drop_unloaded_mtp(self, loaded)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for orig, tensor in weights:
            name = canonical_name(orig)
            if name.startswith("mtp.") and int(name.split(".")[1]) >= len(self.mtp):
                logger.debug("skipping %s: the config has no MTP layer %s", orig, name.split(".")[1])
                continue
            if m := _EXPERT.match(name):  # w1 = gate, w3 = up, w2 = down
                proj = {"w1": "gate", "w3": "up", "w2": "down"}[m.group(3)]
                loaded.add(f"{m.group(1)}.{self.get_submodule(m.group(1)).load_expert(proj, int(m.group(2)), tensor)}")
                continue
            name = fused_expert_name(name)
            if name.endswith((".experts.w13", ".experts.w2")):  # transformers' stacked experts
                module, _, attr = name.rpartition(".")
                self.get_submodule(module).load_stacked(attr, tensor)  # lazy: its slices only
                loaded.add(name)
                continue
            if name not in params:
                raise KeyError(f"checkpoint tensor {orig} has no place in DeepseekV4ForCausalLM")
            target, dst = name, params[name]
            module_name, _, attr = name.rpartition(".")
            module = self.get_submodule(module_name)
            if hasattr(module, "shard"):  # a tensor-parallel layer: this rank's slice
                tensor, _ = module.shard(tensor, None, attr)
            elif attr == "attn_sink":  # one per query head
                tensor = shard_param(dst, tensor)
            tensor = materialize(tensor)
            if dst.shape != tensor.shape:
                raise ValueError(f"{orig}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(dst.shape)}")
            with torch.no_grad():
                dst.copy_(tensor)
            loaded.add(target)
        return loaded

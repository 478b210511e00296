"""The Llama family's step in one kernel call (``lane_llama_decode_layers``): every layer of a
step of decodes and prefill chunks, on the CPU, where the module path would run lane's kernels
for each piece anyway (quantized weights, or bf16 / fp16). At batch 1 the module path spends as
long dispatching its ~20 small ops a layer from Python as the layer's arithmetic takes, and a
chunk pays the same dispatch and a few copies a layer besides; here Python makes one call a step.
The kernels and their order are the module path's, so the two agree to rounding
(tests/test_llama_decode.py). Chunks go this way only where the module path attends them row by
row on the decode kernel (the batch-invariant prefill), so a row's attention is the same call.

``LANE_FUSED_DECODE=0`` keeps the module path (so does tracing with per-layer spans). The
plan (pointers to each layer's weights and caches) is built once, when the caches exist.
"""
from __future__ import annotations

import os

import torch

from lane import tracing
from lane.attention.metadata import PagedAttentionMetadata
from lane.model_executor.layers import cpu_kernels
from lane.model_executor.layers.attention import Attention, prefill_rows_for
from lane.model_executor.layers.linear import Linear, dense_rows, quant_rows
from lane.tracing import Step

ENABLED = os.environ.get("LANE_FUSED_DECODE", "1") != "0"
# decode_layers.cpp's Piece order -> the steps the module path marks
PIECE_STEPS = (Step.OPS_INPUT_NORM, Step.MODEL_QKV_PROJ, Step.OPS_KV_WRITE, Step.OPS_ATTENTION,
               Step.COMM_ATTN_REDUCE, Step.OPS_FFN)
_DENSE, _BLOCKS, _X8, _KQUANT, _PARTS = range(5)
_CACHE_KINDS = {"auto": 0, "int8": 1, "fp8_e4m3": 2}  # decode_layers.cpp's CacheKind


class Unsupported(Exception):
    pass


def _blocks_record(blocks: torch.Tensor, kind: str, x8: bool, bias: torch.Tensor | None, N: int, K: int,
                   keep: list) -> list[int]:
    fmt = _X8 if x8 else _KQUANT if kind in cpu_kernels.K_KINDS else _BLOCKS
    bias = None if bias is None else bias.detach().float().contiguous()
    keep += [blocks, bias]
    return [fmt, blocks.data_ptr(), cpu_kernels.GGML_KINDS[kind][0], 0 if bias is None else bias.data_ptr(), N, K]


def _linear_record(lin: Linear, dtype: torch.dtype, keep: list) -> tuple[list[int], int]:
    """(format, weight, code, bias, N, K) and the most rows this layer takes its kernel for. A
    layer of mixed kinds: (parts, its parts' records, their count, 0, N, K)."""
    if lin.qparts is not None:
        subs = []
        for p in lin.qparts:
            n = p.blocks.shape[0]
            bias = None if lin.bias is None else lin.bias[p.start:p.start + n]
            subs += _blocks_record(p.blocks, p.kind, p.x8, bias, n, lin.in_features, keep)
        recs = torch.tensor(subs, dtype=torch.int64)
        keep.append(recs)
        rows = min(quant_rows(dtype, p.x8) for p in lin.qparts)
        return [_PARTS, recs.data_ptr(), len(lin.qparts), 0, lin.out_features, lin.in_features], rows
    if lin.qweight is not None:
        if lin.qkind not in cpu_kernels.GGML_KINDS:  # int8 / w8a8: the module path
            raise Unsupported(f"{lin.qkind} weights")
        rec = _blocks_record(lin.qweight, lin.qkind, lin.qx8, lin.bias, lin.out_features, lin.in_features, keep)
        return rec, quant_rows(dtype, lin.qx8)
    w = lin.weight.detach()
    code = cpu_kernels.dtype_code(w.dtype)
    if not w.is_contiguous() or code is None:
        raise Unsupported("a non-contiguous dense weight, or a dtype the kernels do not run")
    bias = None if lin.bias is None else lin.bias.detach().to(w.dtype).contiguous()
    keep += [w, bias]
    return [_DENSE, w.data_ptr(), code, 0 if bias is None else bias.data_ptr(), lin.out_features,
            lin.in_features], dense_rows(w.dtype)


class FusedDecode:
    """The plan for one LlamaModel, or ``build`` says why there is none."""

    def __init__(self, model, dtype: torch.dtype) -> None:
        layers = model.layers
        a0 = layers[0].self_attn
        rot = model.rotary
        if rot.cos.dtype != torch.float32:
            raise Unsupported("rope tables not float32")
        keep: list = []  # everything the records point at stays alive with the plan
        recs, rows, quantized = [], [], False
        for layer in layers:
            at = layer.self_attn
            if type(at.attn) is not Attention or at.qk_norm or not at.attn.k_cache.numel():
                raise Unsupported("an attention other than the paged one (or no cache yet)")
            c8 = at.attn.kv_cache_dtype != "auto"
            if (not c8 and at.attn.k_cache.dtype != dtype) or not at.attn.k_cache.is_contiguous():
                raise Unsupported("a cache of another dtype")
            norms = [n.weight.detach().to(dtype).contiguous() for n in
                     (layer.input_layernorm, layer.post_attention_layernorm)]
            keep += norms
            rec = [norms[0].data_ptr(), norms[1].data_ptr()]
            for lin in (at.qkv_proj, at.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                r, n = _linear_record(lin, dtype, keep)
                rec += r
                rows.append(n)
                quantized |= lin.qweight is not None or lin.qparts is not None
            rec += [at.attn.k_cache.data_ptr(), at.attn.v_cache.data_ptr()]
            rec += [at.attn.k_scale.data_ptr(), at.attn.v_scale.data_ptr()] if c8 else [0, 0]
            recs.append(rec)
        if dtype == torch.float32 and not quantized:
            # float32 dense keeps torch's norms and rope, bit-comparable with HF
            raise Unsupported("float32 dense weights")
        self.max_rows = min(rows)
        # C8 (--kv-cache-dtype int8 / fp8_e4m3): the module path's 8-bit cache write and attention
        self.cache_kind = _CACHE_KINDS[a0.attn.kv_cache_dtype]
        fp8_table = cpu_kernels.fp8_e4m3_table()
        keep.append(fp8_table)
        self.model_rec = torch.tensor([len(layers), layers[0].input_layernorm.weight.numel(), a0.num_heads,
                                       a0.num_kv_heads, a0.head_dim, layers[0].mlp.down_proj.in_features,
                                       rot.rotary_dim, a0.attn.k_cache.shape[2], rot.cos.data_ptr(),
                                       rot.sin.data_ptr(), self.cache_kind, fp8_table.data_ptr()], dtype=torch.int64)
        self.layer_recs = torch.tensor(recs, dtype=torch.int64)
        self.keep = keep
        self.caches = (layers[0].self_attn.attn.k_cache.data_ptr(), layers[-1].self_attn.attn.v_cache.data_ptr())
        self.k_cache = layers[0].self_attn.attn.k_cache  # what prefill_rows_for asks of a cache
        self.steps = 0  # steps run fused (tests read it)
        self.mixed_steps = 0  # of which decodes and chunks together
        self.eps = float(layers[0].input_layernorm.eps)
        self.block_size = a0.attn.k_cache.shape[2]
        self.scale = float(a0.attn.scale)
        self.dtype = dtype
        self.times = torch.zeros(len(PIECE_STEPS), dtype=torch.float64)

    @staticmethod
    def ready(model) -> bool:
        """Whether a plan can be made now: the first layer's paged cache is bound."""
        from lane.distributed.parallel_state import get_tp_group

        attn = model.layers[0].self_attn.attn
        return get_tp_group().world_size == 1 and type(attn) is Attention and attn.k_cache.numel() > 0

    @classmethod
    def build(cls, model, dtype: torch.dtype) -> "FusedDecode | None":
        if not ENABLED or not cpu_kernels.available() or cpu_kernels.dtype_code(dtype) is None:
            return None
        try:
            return cls(model, dtype)
        except Unsupported:
            return None

    def current(self, model) -> bool:
        """Whether the caches are the ones the plan points at (the runner binds them all at once,
        so the first and the last tell)."""
        return (model.layers[0].self_attn.attn.k_cache.data_ptr(),
                model.layers[-1].self_attn.attn.v_cache.data_ptr()) == self.caches

    def applies(self, x: torch.Tensor, md) -> bool:
        """A step of decodes (its first rows) and chunks, in row order, each chunk attended row by
        row as the module path would attend it."""
        if not (x.device.type == "cpu" and x.dtype == self.dtype and len(md) == 1
                and isinstance(md[0], PagedAttentionMetadata) and x.shape[0] <= self.max_rows
                and not tracing.tracer.layer_detail):
            return False
        m = md[0]
        row = m.num_decodes
        for span in m.prefills:
            if span.query_start != row:
                return False
            row = span.query_end
        # (over an 8-bit cache the module path attends every chunk row by row)
        return row == x.shape[0] and (not m.prefills or self.cache_kind != 0 or prefill_rows_for(x, self.k_cache))

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, md: PagedAttentionMetadata):
        """x [T, hidden] (the embeddings) -> (x, residual) after the last layer."""
        x = x.contiguous()
        residual = torch.empty_like(x)
        pos = positions.to(torch.int64).contiguous()
        slots = md.slot_mapping.to(torch.int64).contiguous()
        if md.num_decodes:
            tables = md.decode_block_tables.to(torch.int64).contiguous()
            lens = md.decode_context_lens.to(torch.int32).contiguous()
        else:
            tables, lens = torch.zeros(0, 1, dtype=torch.int64), torch.zeros(0, dtype=torch.int32)
        ids = [span.block_ids.to(torch.int64).contiguous() for span in md.prefills]  # alive for the call
        for span, b in zip(md.prefills, ids):
            cpu_kernels.check_chunk_blocks(b, self.block_size, span.num_computed, span.query_end - span.query_start)
        spans = torch.tensor([[span.query_start, span.query_end - span.query_start, span.num_computed, b.data_ptr()]
                              for span, b in zip(md.prefills, ids)], dtype=torch.int64).reshape(-1, 4)
        prof = tracing.forward_profile()
        if prof:
            self.times.zero_()
        cpu_kernels.llama_decode_layers(self.model_rec, self.layer_recs, x, residual, pos, slots, tables, lens, spans,
                                        self.eps, self.scale, self.times if prof else None)
        self.steps += 1
        self.mixed_steps += bool(md.num_decodes and md.prefills)
        if prof:
            for step, seconds in zip(PIECE_STEPS, self.times.tolist()):
                prof.add(step, seconds)
        return x, residual

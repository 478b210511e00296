"""Linear layers, with the CPU paths that make decode fast, every dtype run on every CPU,
and a row's result the same whatever else is in its batch.

Batch-invariant (the default, ``cpu_kernels.BATCH_INVARIANT``): one kernel and one reduction
order per output element for any number of rows, so a token's row computed in a prefill
chunk equals the same row in a decode step, and greedy answers do not change with load:
- GGUF Q4_0 / Q4_1 / Q8_0 / K-quant weights kept in their blocks (``--quantization auto``;
  repacked 8 rows interleaved at prepack where N and the kind allow, cpu_kernels.x8_fits: the
  K-quants on AVX-512 VNNI only): the integer kernel for every M, each row quantized to 8-bit
  blocks once per call, inside it (as llama.cpp runs prefill); the weights are never
  dequantized as a whole. Where the CPU has AMX-BF16, bf16 rows on Q4_0 / Q4_1 take bf16 tiles
  instead, for every M as well: each unit of weight rows dequantized in L1 on the way
  (cpu_kernels.x8_bf16_amx; faster from 16 rows, slower at one or two).
- Dense weights (``--quantization none``, safetensors checkpoints): lane's dense kernel for every
  M (cpu_kernels.small_m_linear: fp32 arithmetic, each weight row streamed once a call for
  decode, register-blocked for prefill). Big prefills pay for it against oneDNN / MKL, whose
  kernels change with the shape (benchmarks/batch_invariance.py states the cost). bf16 rows
  and weights on a CPU with AMX-BF16 take its tiles instead, for every M as well (one chain of
  tile multiplies per output: 7x the FMA kernel at 32 rows, 14x at 512, even at one).
- int8 weights per output channel (``--quantization int8`` / ``w8a8``, quantized at load from a
  safetensors checkpoint): the int8 kernels up to 16 rows, torch's int8 / dequantized GEMMs
  above (not batch-invariant).

``LANE_BATCH_INVARIANT=0`` takes the fastest path per shape instead: the small-M kernel up to a
few rows, then oneDNN (bf16 pre-packed into its blocked layout at load) or MKL, and for GGUF
weights above ``quant_rows`` rows the weight dequantized into a scratch buffer and a dense GEMM.
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from lane import platform
from lane.model_executor.layers import cpu_kernels
from lane.model_executor.layers.vocab_embedding import VocabEmbedding

SMALL_M = 2
F32_ROWS = 32
UPCAST_ROWS = 32
_PACK_BATCH_HINT = 64
_scratch: dict[torch.dtype, torch.Tensor] = {}  # the dequantized weight of the layer running now


def quant_rows(dtype: torch.dtype, x8: bool = False) -> int:
    """Rows up to which GGUF blocks take the integer kernel: every M when batch-invariant; else
    up to where it beats dequantize + GEMM (measured on SmolLM2's shapes): for blocks repacked 8
    rows interleaved, whose cost grows slowly with the rows, 64 (they win to 64-128 rows, bf16 on
    AMX included); else 16 where the CPU's GEMM runs the dtype natively and fast (bf16 on
    oneDNN), 32 elsewhere."""
    if cpu_kernels.BATCH_INVARIANT:
        return sys.maxsize
    if x8:
        return 64
    return 16 if dtype != torch.float32 and fast_cpu_gemm(dtype) else 32


def dequantized(blocks: torch.Tensor, kind: str, shape: tuple[int, int], dtype: torch.dtype,
                x8: bool = False) -> torch.Tensor:
    """The weight as ``dtype`` in a scratch buffer that the next call overwrites: one
    buffer for the whole model, so prefill allocates (and page-faults) nothing per layer.
    ``x8``: the blocks are in cpu_kernels.repack_x8's layout."""
    n = shape[0] * shape[1]
    buf = _scratch.get(dtype)
    if buf is None or buf.numel() < n:
        buf = _scratch[dtype] = torch.empty(n, dtype=dtype)
    if x8:
        return cpu_kernels.dequant_x8(blocks, kind, shape[0], shape[1], dtype, out=buf[:n])
    return cpu_kernels.dequant_ggml(blocks.numpy(), kind, dtype, out=buf[:n]).view(shape)


def dense_rows(dtype: torch.dtype) -> int:
    """Rows up to which a dense weight of this dtype runs lane's kernel, not torch's GEMM: every
    M when batch-invariant; else float32 up to 32 (4 weight rows a pass: flat where MKL's sgemm
    steps 1.4x from 3 rows to 4, and as fast at 32), native bf16 up to SMALL_M (oneDNN's AMX /
    packed GEMM wins), other dtypes up to UPCAST_ROWS."""
    if cpu_kernels.BATCH_INVARIANT:
        return sys.maxsize
    if not fast_cpu_gemm(dtype):
        return UPCAST_ROWS
    return F32_ROWS if dtype == torch.float32 and cpu_kernels.isa() in ("avx2", "avx512") else SMALL_M


@functools.cache
def fast_cpu_gemm(dtype: torch.dtype) -> bool:
    """Whether torch's CPU GEMM runs this dtype natively here (capped by LANE_CPU_ISA)."""
    if dtype == torch.bfloat16:
        return platform.onednn_bf16_gemm()
    return dtype == torch.float32


@dataclass
class QuantPart:
    """Rows [start, start + blocks.shape[0]) of a fused layer whose parts came in different GGUF
    kinds (Q4_K_M files keep some layers' attn_v in Q6_K beside Q4_K q and k), kept as blocks."""
    start: int
    kind: str
    blocks: torch.Tensor
    x8: bool = False  # repacked 8 rows interleaved (cpu_kernels.repack_x8)


class Linear(nn.Linear):
    packed_weight: torch.Tensor | None = None
    # A quantized weight, by kind: GGUF blocks kept as they are (a kind of cpu_kernels.GGML_KINDS:
    # uint8 [out_features, row bytes]), or int8 per output channel ("int8": W8A16, "w8a8": the
    # activations quantized per token too; int8 [out_features, in_features] and weight_scale)
    qweight: torch.Tensor | None = None
    qkind: str | None = None
    weight_scale: torch.Tensor | None = None  # int8: fp32 [out_features]
    weight_sums: torch.Tensor | None = None  # w8a8: int32 [out_features], the VNNI offset's correction
    dense_dtype: torch.dtype | None = None  # the weight's dtype, for a GGUF layer that goes dense after all
    qx8 = False  # qweight's blocks repacked 8 rows interleaved (cpu_kernels.repack_x8)
    # a fused layer of mixed GGUF kinds: its parts' blocks, in row order once prepacked (qweight
    # is None and qkind names the kinds, "Q4_K+Q6_K")
    qparts: list[QuantPart] | None = None
    _qrows: list[tuple[int, int]] | None = None  # (start, rows) of qweight loaded so far
    _parts_joined = False

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 quantizable: bool | None = None) -> None:
        super().__init__(in_features, out_features, bias, device, dtype)
        # whether --quantization int8 / w8a8 may quantize it: not a weight the model reads as a
        # matrix itself, an LM head, or one it keeps in float32 on purpose (dtype given)
        self.quantizable = dtype is None if quantizable is None else quantizable

    def quantized_tensors(self) -> list[torch.Tensor | None]:
        return [self.qweight, self.weight_scale, self.weight_sums, *(p.blocks for p in self.qparts or ())]

    def quantize_int8(self, activations: bool) -> None:
        """--quantization int8 / w8a8: the loaded weight to int8 per output channel; the dense
        weight goes."""
        self.qweight, self.weight_scale = cpu_kernels.quantize_weight_int8(self.weight.detach())
        self.qkind = "w8a8" if activations else "int8"
        if activations:
            self.weight_sums = cpu_kernels.int8_weight_sums(self.qweight)
        self.weight = None

    def load_quantized(self, kind: str, blocks: torch.Tensor, row_offset: int = 0) -> None:
        """Take GGUF blocks for rows [row_offset, row_offset + len(blocks)) of the weight
        (a fused layer gets its parts one by one); the dense weight is dropped."""
        if self.qparts is not None:  # a fused layer of mixed kinds
            self._add_part(QuantPart(row_offset, kind, blocks))
            return
        if self.qweight is None:
            self.dense_dtype = self.weight.dtype
        if self.qweight is None and row_offset == 0 and blocks.shape[0] == self.out_features:
            self.qweight, self.qkind, self.weight = blocks, kind, None  # the whole weight: kept as given
            return
        if self.qweight is None:
            self.qweight = torch.empty(self.out_features, blocks.shape[1], dtype=torch.uint8)
            self.qkind, self._qrows = kind, []
            self.weight = None  # its memory goes; forward reads the blocks
        if kind != self.qkind or blocks.shape[1] != self.qweight.shape[1]:
            # parts of different kinds: each keeps its blocks and runs its own kernel (dense,
            # they would read 3-4x the bytes a decode step)
            done = [QuantPart(s, self.qkind, self.qweight[s:s + n].clone()) for s, n in self._qrows]
            self.qweight, self.qparts = None, []
            for part in [*done, QuantPart(row_offset, kind, blocks)]:
                self._add_part(part)
            return
        self.qweight[row_offset:row_offset + blocks.shape[0]] = blocks
        self._qrows.append((row_offset, blocks.shape[0]))

    def _add_part(self, part: QuantPart) -> None:
        self.qparts.append(part)
        self._parts_joined = False
        self.qkind = "+".join(dict.fromkeys(p.kind for p in self.qparts))

    def _join_parts(self) -> None:
        """The parts in row order, runs of one kind joined into one kernel call's blocks; every
        row must be loaded."""
        parts: list[QuantPart] = []
        for p in sorted(self.qparts, key=lambda p: p.start):
            last = parts[-1] if parts else None
            end = last.start + last.blocks.shape[0] if last else 0
            if p.start != end:
                raise ValueError(f"a fused layer's GGUF parts leave rows {end}..{p.start} unloaded")
            if last and last.kind == p.kind and not last.x8 and not p.x8:
                parts[-1] = QuantPart(last.start, last.kind, torch.cat([last.blocks, p.blocks]))
            else:
                parts.append(p)
        if parts[-1].start + parts[-1].blocks.shape[0] != self.out_features:
            raise ValueError("a fused layer's GGUF parts leave its last rows unloaded")
        self.qparts, self._parts_joined = parts, True

    def prepack(self) -> bool:
        """Repack GGUF blocks 8 rows interleaved (cpu_kernels.repack_x8), or pack the dense weight
        for oneDNN (only bf16 on a CPU whose oneDNN runs bf16 benefits)."""
        if self.qparts is not None:
            self._join_parts()
            for p in self.qparts:
                packed = None if p.x8 else cpu_kernels.repack_x8(p.blocks, p.kind, p.blocks.shape[0])
                if packed is not None:
                    p.blocks, p.x8 = packed, True
            return any(p.x8 for p in self.qparts)
        if self.qweight is not None:
            packed = None if self.qx8 else cpu_kernels.repack_x8(self.qweight, self.qkind, self.out_features)
            if packed is not None:
                self.qweight, self.qx8 = packed, True
            return packed is not None
        w = self.weight
        if cpu_kernels.BATCH_INVARIANT:  # every M runs lane's dense kernel on the weight as it is
            return False
        if w is None or (w.device.type != "cpu" or w.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available()
                or not fast_cpu_gemm(torch.bfloat16)):
            return False
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _PACK_BATCH_HINT)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None or self.qparts is not None:
            return self._quantized(x)
        if self.packed_weight is not None and x.dim() == 2 and x.shape[0] > SMALL_M:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        return linear(x, self.weight, self.bias)

    def _quantized(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self.qkind in ("int8", "w8a8"):  # these have torch paths too
            y = int8_linear(x2, self.qkind, self.qweight, self.weight_scale, self.weight_sums, self.bias)
        elif self.qparts is not None:
            if not self._parts_joined:  # a forward before prepack
                self._join_parts()
            y = torch.cat([ggml_linear(x2, p.blocks, p.kind, (p.blocks.shape[0], self.in_features),
                                       None if self.bias is None else self.bias[p.start:p.start + p.blocks.shape[0]],
                                       p.x8) for p in self.qparts], dim=1)
        else:
            y = ggml_linear(x2, self.qweight, self.qkind, (self.out_features, self.in_features), self.bias, self.qx8)
        return y.view(*lead, self.out_features)


def ggml_linear(x: torch.Tensor, blocks: torch.Tensor, kind: str, shape: tuple[int, int],
                bias: torch.Tensor | None = None, x8: bool = False, int8: bool = False) -> torch.Tensor:
    """x [M, K] by a weight [N, K] kept in GGUF blocks (a Linear's, or one expert's): the integer
    kernel for few rows, else the weight dequantized into the scratch buffer and a GEMM.
    ``int8``: never the dequantizing bf16 tiles (cpu_kernels.quant_linear)."""
    if not cpu_kernels.usable(x):
        raise RuntimeError("GGUF blocks need the CPU kernels (LANE_CPU_KERNELS=0 or a failed build); "
                           "load with --quantization none")
    if x.shape[0] <= quant_rows(x.dtype, x8):
        return cpu_kernels.quant_linear(x, blocks, kind, shape[0], bias, x8, int8)
    return linear(x, dequantized(blocks, kind, shape, x.dtype, x8), bias)


def int8_linear(x: torch.Tensor, kind: str, qweight: torch.Tensor, scale: torch.Tensor,
                sums: torch.Tensor | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] by an int8 weight (a Linear's, or one expert's): W8A16 or W8A8."""
    if kind == "w8a8":
        return cpu_kernels.int8_linear_w8a8(x, qweight, scale, bias, sums)
    return cpu_kernels.int8_linear_w8a16(x, qweight, scale, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` that takes the small-M kernel for decode rows, and fp32 math for
    dtypes the CPU's GEMM does not run natively."""
    if x.device.type != "cpu":
        return F.linear(x, weight, bias)
    if x.shape[:-1].numel() <= dense_rows(weight.dtype) and cpu_kernels.usable(x) and weight.is_contiguous():
        x2 = x.reshape(-1, x.shape[-1])
        return cpu_kernels.small_m_linear(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])
    if fast_cpu_gemm(weight.dtype):
        return F.linear(x, weight, bias)
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


def prepack_linears(model: nn.Module) -> int:
    """Pack every Linear of a loaded model, and repack MoE experts' GGUF blocks; returns how many
    modules were packed. Blocks a tied embedding reads too are repacked once, for both; blocks
    another kind of module reads stay."""
    holders: dict[int, list[nn.Module]] = {}
    for m in model.modules():
        if not isinstance(m, Linear) and hasattr(m, "quantized_tensors"):
            for t in m.quantized_tensors():
                if t is not None:
                    holders.setdefault(t.data_ptr(), []).append(m)
    packed = 0
    for m in model.modules():
        if hasattr(m, "prepack_experts"):  # a FusedMoE's GGUF expert stacks
            packed += m.prepack_experts()
            continue
        if not isinstance(m, Linear):
            continue
        others = holders.get(m.qweight.data_ptr(), []) if m.qweight is not None else []
        if not all(isinstance(o, VocabEmbedding) for o in others) or not m.prepack():
            continue
        packed += 1
        for o in others:  # the tied embedding looks its rows up in the repacked blocks
            o.qweight, o.qx8 = m.qweight, True
    return packed


def kernels_in_float32(model: nn.Module) -> bool:
    """A model whose linears are GGUF blocks runs its float32 norms, rope and SwiGLU on the
    kernels, as its fused decode step does, so that its prefill rows equal its decode rows (a
    dense float32 model keeps torch's, bit-comparable with HF). True when it does."""
    quantized = any(isinstance(m, Linear) and (m.qkind in cpu_kernels.GGML_KINDS or m.qparts is not None)
                    for m in model.modules())
    for m in model.modules():
        if hasattr(type(m), "kernels_float32"):
            m.kernels_float32 = quantized
    return quantized

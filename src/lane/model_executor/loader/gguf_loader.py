"""GGUF weights (seed step 4), dequantised. A GGUF's config and tokenizer are built in
lane.transformers_utils, which the API server uses without loading this module.

Metadata and tensor records come from ``transformers_utils.gguf_file.GGUFFile`` (memory-mapped);
the ``gguf`` package supplies the quantisation tables and the fallback dequantiser. F32/F16/BF16
are converted here in torch, the kinds of ``cpu_kernels.GGML_KINDS`` (Q8_0/Q4_0/Q4_1 and the
K-quants Q4_K/Q5_K/Q6_K) dequantised by the CPU kernel (Q8_0/Q4_0/Q4_1 in torch without it);
other quantisation types fall back to gguf's numpy dequantiser. llama.cpp stores Llama's Q and
K rows permuted for its rope kernel; we undo that so the weights match HF's rotate-half layout.
"""
from __future__ import annotations

import re
import warnings
from collections import Counter
from typing import Iterator

import numpy as np
import torch

from lane.model_executor.layers import cpu_kernels
from lane.transformers_utils.gguf_file import gguf_field

_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # MoE (qwen3moe): the router, and each projection of every expert stacked [E, rows, cols]
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_stack",
    "ffn_up_exps": "mlp.experts.up_stack",
    "ffn_down_exps": "mlp.experts.down_stack",
}


# -- dequantisation ----------------------------------------------------------

def _f16(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] values: low nibbles first, then high."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()


def dequantize(data: np.ndarray, qtype: int, shape: tuple[int, ...],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One GGUF tensor -> a torch tensor of ``shape`` (torch order) in ``dtype``. The
    values are gguf's reference (and so transformers'): float32 math, then one rounding
    to ``dtype``. The GGML_KINDS go through the CPU kernel where it is built."""
    import gguf

    Q = gguf.GGMLQuantizationType
    if Q(qtype).name in cpu_kernels.GGML_KINDS and cpu_kernels.build():  # waits for a build in flight
        # read in place from the mmap: no copy
        return cpu_kernels.dequant_ggml(np.ascontiguousarray(data).view(np.uint8), Q(qtype).name,
                                        dtype).reshape(shape)
    raw = torch.from_numpy(np.array(data, copy=True))  # the mmap is read-only
    if qtype == Q.F32:
        return raw.view(torch.float32).reshape(shape).to(dtype, copy=True)
    if qtype == Q.F16:
        return raw.view(torch.float16).reshape(shape).float().to(dtype)
    if qtype == Q.BF16:
        return raw.view(torch.int16).view(torch.bfloat16).reshape(shape).float().to(dtype)
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        blocks = raw.view(torch.uint8).reshape(-1, type_size)
        d = _f16(blocks[:, 0:2])
        if qtype == Q.Q8_0:
            vals = d * blocks[:, 2:].contiguous().view(torch.int8).float()
        elif qtype == Q.Q4_0:
            vals = d * (_nibbles(blocks[:, 2:]) - 8.0)
        else:
            m = _f16(blocks[:, 2:4])
            vals = d * _nibbles(blocks[:, 4:]) + m
        return vals.reshape(shape).to(dtype)
    # any other type: gguf's reference numpy dequantiser
    return torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32)).reshape(shape).to(dtype)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rope -> rotate-half)."""
    d = w.shape[0]
    return w.reshape(n_head, d // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensor_name(gguf_name: str) -> str | None:
    m = re.match(r"blk\.(\d+)\.(\w+)\.(weight|bias)$", gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part not in _TENSOR_NAMES:
            return None
        return f"model.layers.{layer}.{_TENSOR_NAMES[part]}.{kind}"
    base, _, kind = gguf_name.rpartition(".")
    return f"{_TENSOR_NAMES[base]}.{kind}" if base in _TENSOR_NAMES else None


class GGMLBlocks:
    """A GGUF weight [N, K] kept in its blocks: ``blocks`` uint8 [N, K / block values * block
    bytes], one row of blocks per output row (rows can be permuted and concatenated as they are).
    A stack of experts' weights [E, N, K] comes as [E * N, K], expert e's rows at e * N.
    ``dequantized`` counts the kinds of those a model dequantizes after all."""

    def __init__(self, kind: str, shape: tuple[int, int], blocks: torch.Tensor, dtype: torch.dtype,
                 dequantized: Counter | None = None) -> None:
        self.kind, self.shape, self.blocks, self.dtype = kind, tuple(shape), blocks, dtype
        self.dequantized = dequantized

    def narrow(self, dim: int, start: int, length: int) -> "GGMLBlocks | torch.Tensor":
        """A tensor-parallel rank's slice, copied (the whole weight's blocks can then go): rows
        as they are; columns (the input dimension) on whole blocks, else dequantized first."""
        if dim == 0:
            return GGMLBlocks(self.kind, (length, self.shape[1]), self.blocks[start:start + length].clone(),
                              self.dtype, self.dequantized)
        _, values, size = cpu_kernels.GGML_KINDS[self.kind]
        if start % values or length % values:
            return self.dequantize().narrow(dim, start, length)
        cols = slice(start // values * size, (start + length) // values * size)
        blocks = self.blocks[:, cols].clone(memory_format=torch.contiguous_format)
        return GGMLBlocks(self.kind, (self.shape[0], length), blocks, self.dtype, self.dequantized)

    def dequantize(self) -> torch.Tensor:
        import gguf

        if self.dequantized is not None:
            self.dequantized[self.kind] += 1
        return dequantize(self.blocks.numpy(), int(gguf.GGMLQuantizationType[self.kind]), self.shape, self.dtype)


def keeps_blocks(t) -> bool:
    """Whether a GGUF tensor can stay in its blocks: a 2-D weight of a kind the kernels run
    (cpu_kernels.GGML_KINDS), its rows whole blocks."""
    import gguf

    kind = cpu_kernels.GGML_KINDS.get(gguf.GGMLQuantizationType(t.tensor_type).name)
    return kind is not None and len(t.shape) in (2, 3) and t.shape[-1] % kind[1] == 0


def iter_gguf_weights(reader, hf_config, dtype: torch.dtype = torch.float32, keep_quantized: bool = False,
                      dequantized: Counter | None = None) -> Iterator[tuple[str, "torch.Tensor | GGMLBlocks"]]:
    """(HF name, tensor) for every tensor; with ``keep_quantized``, 2-D tensors of a kind in
    ``cpu_kernels.GGML_KINDS`` whose rows are whole blocks come as their blocks (the model
    keeps them in its linear layers, and dequantizes those it needs dense, as an embedding).
    ``dequantized`` counts, by kind, the quantized tensors dequantized at load."""
    import gguf

    from lane.distributed.parallel_state import get_tp_group

    # over several ranks the blocks stay in the mapped file until a rank's layer copies out its
    # slice (GGMLBlocks.narrow): only that slice is read
    in_place = get_tp_group().world_size > 1
    arch = gguf_field(reader, "general.architecture")
    floats = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            continue
        heads = None
        if arch in ("llama", "mistral"):
            if name.endswith("self_attn.q_proj.weight"):
                heads = hf_config.num_attention_heads
            elif name.endswith("self_attn.k_proj.weight"):
                heads = hf_config.num_key_value_heads
        kind = gguf.GGMLQuantizationType(t.tensor_type).name
        if keep_quantized and keeps_blocks(t):
            data = np.asarray(t.data) if in_place and heads is None else np.array(t.data, copy=True)
            with warnings.catch_warnings():  # a read-only view of the mapped file: nothing writes to it
                warnings.simplefilter("ignore", UserWarning)
                rows = int(np.prod(t.shape[:-1]))  # a stack of experts' rows one after another
                blocks = torch.from_numpy(data).view(rows, -1)
            if heads is not None:  # rows of blocks permute as rows of weights do
                blocks = _unpermute(blocks, heads).contiguous()
            yield name, GGMLBlocks(kind, (rows, t.shape[-1]), blocks, dtype, dequantized)
            continue
        if dequantized is not None and t.tensor_type not in floats:
            dequantized[kind] += 1
        w = dequantize(t.data, t.tensor_type, t.shape, dtype)
        yield name, (_unpermute(w, heads) if heads is not None else w)

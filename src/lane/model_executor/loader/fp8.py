"""FP8 block-quantised checkpoints (DeepSeek V3 / V3.2 / V4): dequantised on load.

Each quantised linear weight ``W`` (float8_e4m3fn, [N, K]) comes with
``W_scale_inv`` (V4: ``W.scale``; float32, [ceil(N / bn), ceil(K / bk)]): one scale per bn x bk
block (128 x 128 in DeepSeek's releases), the last blocks possibly partial.
The real weight is ``W * scale_inv`` block by block. A weight and its scale may
arrive in any order, from different files and threads, so each waits for the
other. Over several ranks the pair stays lazy (``LazyFp8``): a rank's slice reads only its
rows (or columns) of the weight and dequantizes them with the scale blocks they fall in.
"""
from __future__ import annotations

import threading
from typing import Callable

import torch

from lane.model_executor.loader.safetensors_loader import LazyTensor, materialize

FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
# scale name suffix -> what replaces it to name the weight: DeepSeek V3's HF releases use
# "W.weight_scale_inv"; V4's "W.scale" (only read as a scale in an fp8-quantised config)
SCALE_SUFFIXES = {"_scale_inv": ""}
V4_SCALE_SUFFIXES = {"_scale_inv": "", ".scale": ".weight"}


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor,
                         block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """[N, K] fp8 weight, [ceil(N/bn), ceil(K/bk)] scales -> float32 [N, K]."""
    return LazyFp8(weight, scale_inv, block).full()


class LazyFp8(LazyTensor):
    """An fp8 weight not read yet (a LazyTensor; or a tensor), with its (small, read) block
    scales: reads as float32, a slice at a time (``narrow`` / ``[index]``, basic slices), or
    whole (``full``)."""

    def __init__(self, weight: "LazyTensor | torch.Tensor", scale_inv: torch.Tensor, block: tuple[int, int]) -> None:
        n, k = weight.shape
        if scale_inv.shape != (-(-n // block[0]), -(-k // block[1])):
            raise ValueError(f"scale shape {tuple(scale_inv.shape)} does not fit a {n}x{k} weight "
                             f"in {block[0]}x{block[1]} blocks")
        self._weight, self._scale, self._block = weight, scale_inv.float(), block
        self.shape, self.dtype = weight.shape, torch.float32

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        index = tuple(index) + (slice(None),) * (2 - len(index))
        (r0, r1, _), (c0, c1, _) = (ix.indices(size) for ix, size in zip(index, self.shape))
        (bn, bk), q = self._block, self._weight[index]
        scale = self._scale[r0 // bn:-(-r1 // bn), c0 // bk:-(-c1 // bk)]  # the blocks the slice falls in
        scale = scale.repeat_interleave(bn, 0)[r0 % bn:r0 % bn + (r1 - r0)]
        scale = scale.repeat_interleave(bk, 1)[:, c0 % bk:c0 % bk + (c1 - c0)]
        return q.float() * scale

    def full(self) -> torch.Tensor:
        return self[(slice(None), slice(None))]


def _quant_config(hf_config) -> dict:
    qc = getattr(hf_config, "quantization_config", None) or {}
    return qc if isinstance(qc, dict) else qc.to_dict()


def block_size_of(hf_config) -> tuple[int, int]:
    bn, bk = _quant_config(hf_config).get("weight_block_size") or (128, 128)
    return int(bn), int(bk)


def scale_suffixes_of(hf_config) -> dict[str, str]:
    return V4_SCALE_SUFFIXES if _quant_config(hf_config).get("quant_method") == "fp8" else SCALE_SUFFIXES


class Fp8Dequantizer:
    """Wraps a ``consume(name, tensor)``: fp8 weights and their scales are held
    until both are in, then the dequantised weight is passed on; everything else
    passes straight through."""

    def __init__(self, consume: Callable[[str, torch.Tensor], None], block: tuple[int, int],
                 scale_suffixes: dict[str, str] | None = None) -> None:
        self.consume = consume
        self.block = block
        self.scale_suffixes = scale_suffixes or SCALE_SUFFIXES
        self.lock = threading.Lock()
        self.weights: dict[str, torch.Tensor] = {}
        self.scales: dict[str, torch.Tensor] = {}  # keyed by the weight's name
        self.num_dequantized = 0

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        suffix = next((s for s in self.scale_suffixes if name.endswith(s)), None)
        if suffix is not None and tensor.dim() == 2 and tensor.dtype not in FP8_DTYPES:  # block scales are 2-D
            key, store, other = name[:-len(suffix)] + self.scale_suffixes[suffix], self.scales, self.weights
        elif tensor.dtype in FP8_DTYPES:
            key, store, other = name, self.weights, self.scales
        else:
            self.consume(name, tensor)
            return
        if store is self.scales:
            tensor = materialize(tensor)  # a scale is small: read whole
        with self.lock:
            mate = other.pop(key, None)
            if mate is None:
                store[key] = tensor
                return
            self.num_dequantized += 1
        weight, scale = (tensor, mate) if store is self.weights else (mate, tensor)
        if isinstance(weight, LazyTensor):  # a rank's slice of it is read when its layer asks
            self.consume(key, LazyFp8(weight, scale, self.block))
        else:
            self.consume(key, dequantize_block_fp8(weight, scale, self.block))

    def finish(self) -> None:
        if self.weights or self.scales:
            lone = sorted(self.weights)[:3] + [f"scale of {k}" for k in sorted(self.scales)[:3]]
            raise ValueError(f"fp8 checkpoint: {len(self.weights)} weights without a scale and "
                             f"{len(self.scales)} scales without a weight, e.g. {lone}")

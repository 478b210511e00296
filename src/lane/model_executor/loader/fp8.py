"""FP8 block-quantised checkpoints (DeepSeek V3 / V3.2 / V4): dequantised on load.

Each quantised linear weight ``W`` (float8_e4m3fn, [N, K]) comes with
``W_scale_inv`` (V4: ``W.scale``; float32, [ceil(N / bn), ceil(K / bk)]): one scale per bn x bk
block (128 x 128 in DeepSeek's releases), the last blocks possibly partial.
The real weight is ``W * scale_inv`` block by block. A weight and its scale may
arrive in any order, from different files and threads, so each waits for the
other.
"""
from __future__ import annotations

import threading
from typing import Callable

import torch

FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
# scale name suffix -> what replaces it to name the weight: DeepSeek V3's HF releases use
# "W.weight_scale_inv"; V4's "W.scale" (only read as a scale in an fp8-quantised config)
SCALE_SUFFIXES = {"_scale_inv": ""}
V4_SCALE_SUFFIXES = {"_scale_inv": "", ".scale": ".weight"}


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor,
                         block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """[N, K] fp8 weight, [ceil(N/bn), ceil(K/bk)] scales -> float32 [N, K]."""
    n, k = weight.shape
    bn, bk = block
    if scale_inv.shape != (-(-n // bn), -(-k // bk)):
        raise ValueError(f"scale shape {tuple(scale_inv.shape)} does not fit a {n}x{k} weight "
                         f"in {bn}x{bk} blocks")
    scale = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return weight.float() * scale


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
        from lane.model_executor.loader.safetensors_loader import materialize

        tensor = materialize(tensor)  # dequantized whole (its blocks' scales span the slices)
        with self.lock:
            mate = other.pop(key, None)
            if mate is None:
                store[key] = tensor
                return
            self.num_dequantized += 1
        weight, scale = (tensor, mate) if store is self.weights else (mate, tensor)
        self.consume(key, dequantize_block_fp8(weight, scale, self.block))

    def finish(self) -> None:
        if self.weights or self.scales:
            lone = sorted(self.weights)[:3] + [f"scale of {k}" for k in sorted(self.scales)[:3]]
            raise ValueError(f"fp8 checkpoint: {len(self.weights)} weights without a scale and "
                             f"{len(self.scales)} scales without a weight, e.g. {lone}")

"""Rotary position embedding (neox / rotate-half layout, as HF Llama/Qwen use).

The inverse frequencies come from transformers' own rope initialisers, so every
rope type a config names (default, llama3, linear, yarn, ...) matches HF exactly.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from lane.model_executor.layers import cpu_kernels


def compute_inv_freq(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
        dim = int(head_dim * factor)
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv_freq, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    kernels_float32 = False  # float32 on the kernels too (linear.kernels_in_float32)

    def __init__(self, hf_config, head_dim: int, max_position: int) -> None:
        super().__init__()
        inv_freq, scaling = compute_inv_freq(hf_config, head_dim)
        self.rotary_dim = inv_freq.numel() * 2
        self.head_dim = head_dim
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        # cache [max_pos, rotary_dim]: cos and sin of each half, repeated as HF does
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple:
        """Once per forward, shared by every layer: the positions, and for the
        torch path their cos / sin rows in the model dtype."""
        if cpu_kernels.fused_for(dtype, positions.device, self.kernels_float32):
            return positions, None, None
        return (positions, self.cos[positions].unsqueeze(1).to(dtype),
                self.sin[positions].unsqueeze(1).to(dtype))

    def forward(self, rope: tuple, q: torch.Tensor, k: torch.Tensor):
        """q: [T, H, D], k: [T, KV, D] -> rotated (in place on the fused path)."""
        return self.rotate(rope, q), self.rotate(rope, k)

    def rotate(self, rope: tuple, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D] rotated at ``rope``'s positions (in place on the fused path)."""
        positions, cos, sin = rope
        if cos is None:
            cpu_kernels.rotary_(x, positions, self.cos, self.sin)
            return x
        return self._apply(x, cos, sin)

    def _apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rd = self.rotary_dim
        rot, rest = (x, None) if rd == x.shape[-1] else (x[..., :rd], x[..., rd:])
        half = rd // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        out = rot * cos + torch.cat((-x2, x1), dim=-1) * sin
        return out if rest is None else torch.cat((out, rest), dim=-1)


def rope_rows(rope: tuple, lo: int, hi: int) -> tuple:
    """``prepare``'s result for rows [lo, hi) of the forward."""
    return tuple(None if t is None else t[lo:hi] for t in rope)

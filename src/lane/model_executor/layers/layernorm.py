"""RMSNorm, with the residual add fused in (as vLLM's layer takes it)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lane.model_executor.layers import cpu_kernels


class RMSNorm(nn.Module):
    kernels_float32 = False  # float32 on the kernels too (linear.kernels_in_float32)

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; with ``residual``: returns (norm(x + residual), x + residual)."""
        if cpu_kernels.fused_usable(x, self.kernels_float32) and x.is_contiguous():
            if residual is None:
                out = x.clone()
                cpu_kernels.rms_norm_(out, None, self.weight, self.eps)
                return out
            if residual.is_contiguous():  # both updated in place: one pass
                cpu_kernels.rms_norm_(x, residual, self.weight, self.eps)
                return x, residual
        if residual is not None:
            x = x + residual
            residual = x
        # HF computes the norm in float32 and casts back before the weight
        out = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight
        return out if residual is None else (out, residual)

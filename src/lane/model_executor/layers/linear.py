"""Linear layers, with the CPU paths that make decode fast.

- One or two rows (decode of one or two sequences): the small-M kernel streams
  each weight row once; torch's GEMM reads weights at a fraction of bandwidth.
- More rows, bf16 on a CPU: oneDNN with the weight pre-packed into its blocked
  layout once at load (15-45% faster than ``F.linear``, which re-lays the
  weight out on every call). The dense weight stays for the small-M path and
  for weight loading, so packing costs one more copy of the linear weights.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lane.model_executor.layers import cpu_kernels

SMALL_M = 2
_PACK_BATCH_HINT = 64


class Linear(nn.Linear):
    packed_weight: torch.Tensor | None = None

    def prepack(self) -> bool:
        """Pack the weight for oneDNN; only bf16 on a CPU with oneDNN benefits."""
        w = self.weight
        if w.device.type != "cpu" or w.dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
            return False
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(w.detach(), _PACK_BATCH_HINT)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            if x.shape[0] <= SMALL_M and cpu_kernels.usable(x):
                return cpu_kernels.small_m_linear(x, self.weight, self.bias)
            if self.packed_weight is not None:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias,
                                                          "none", [], "")
        return F.linear(x, self.weight, self.bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` that takes the small-M kernel for one or two rows (decode)."""
    if x.dim() == 2 and x.shape[0] <= SMALL_M and cpu_kernels.usable(x) and weight.is_contiguous():
        return cpu_kernels.small_m_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def prepack_linears(model: nn.Module) -> int:
    """Pack every Linear of a loaded model; returns how many were packed."""
    return sum(m.prepack() for m in model.modules() if isinstance(m, Linear))

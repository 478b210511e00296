"""Linear layers. On a CPU, decode steps with a few sequences multiply by a
handful of rows (M <= 8); torch's GEMM reads the weights slowly there, so those
go through the small-M kernel, and everything else through torch."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lane.model_executor.layers import cpu_kernels

SMALL_M = 4


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= SMALL_M and cpu_kernels.usable(x):
            return cpu_kernels.small_m_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

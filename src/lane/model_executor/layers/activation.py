import torch
import torch.nn.functional as F

from lane.model_executor.layers import cpu_kernels


def silu_and_mul(x: torch.Tensor, kernels_float32: bool = False) -> torch.Tensor:
    """SwiGLU on a fused [gate | up] projection (``kernels_float32``: cpu_kernels.fused_for's)."""
    if cpu_kernels.fused_usable(x, kernels_float32) and x.dim() == 2 and x.is_contiguous():
        return cpu_kernels.silu_and_mul(x)
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]

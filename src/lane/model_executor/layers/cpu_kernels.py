"""Optional compiled CPU kernels. Until built, everything runs on the torch paths."""
from __future__ import annotations

import torch

_ext = None


def usable(x: torch.Tensor) -> bool:
    return _ext is not None and x.device.type == "cpu"


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
    return _ext.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)

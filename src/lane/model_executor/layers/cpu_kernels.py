"""Compiled CPU kernels, built once per machine on first use (torch's C++
extension loader, cached per checkout and source version under ~/.cache/lane/kernels).

Paged decode attention in torch must gather every request's blocks into a
padded copy first; on a CPU that copy costs more than the attention itself.
The kernel reads K/V in place. Likewise torch's GEMM for one to a few rows
(decode) reads weights at a fraction of memory bandwidth; ``small_m_linear``
streams each weight row once. If the build fails (no C++ compiler), the torch
paths run instead, with a warning. ``LANE_CPU_KERNELS=0`` turns them off.
"""
from __future__ import annotations

import logging
import os
import time

import torch

logger = logging.getLogger(__name__)

_ext = None
_tried = False
_SOURCES = [os.path.join(os.path.dirname(__file__), "csrc", f)
            for f in ("bindings.cpp", "paged_attention.cpp", "gemv.cpp", "elementwise.cpp")]


def build() -> bool:
    """Build (or load the cached build of) the kernels; True when usable."""
    global _ext, _tried
    if _tried:
        return _ext is not None
    _tried = True
    if os.environ.get("LANE_CPU_KERNELS", "1") == "0":
        return False
    try:
        from torch.utils.cpp_extension import load

        t0 = time.perf_counter()
        logger.info("Loading the CPU kernels (compiled on first use on this machine: about a minute then)")
        _ext = load(name="lane_cpu_kernels", sources=_SOURCES, build_directory=_build_dir(),
                    extra_cflags=["-O3", "-march=native", "-ffast-math", "-mprefer-vector-width=512", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
        logger.info("CPU kernels ready in %.1f s", time.perf_counter() - t0)
    except Exception as e:  # no compiler, no ninja, ...: the torch paths still work
        logger.warning("CPU kernels unavailable, using the torch paths (%s)", str(e).splitlines()[0])
        _ext = None
    return _ext is not None


def _build_dir() -> str:
    """One build per checkout and source version: two checkouts (a clean-clone CI next to
    a working tree) would otherwise rebuild torch's shared default directory in turn."""
    import hashlib

    digest = hashlib.sha256()
    for path in _SOURCES:
        digest.update(path.encode())
        with open(path, "rb") as f:
            digest.update(f.read())
    root = os.environ.get("LANE_KERNEL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "lane", "kernels"))
    path = os.path.join(root, digest.hexdigest()[:16])
    os.makedirs(path, exist_ok=True)
    return path


def available() -> bool:
    return _ext is not None


def usable(x: torch.Tensor) -> bool:
    return _ext is not None and x.device.type == "cpu"


def fused_for(dtype: torch.dtype, device: torch.device) -> bool:
    """The fused element-wise kernels round once where torch rounds after every
    op: used for bf16 only, so float32 stays bit-comparable with HF."""
    return _ext is not None and device.type == "cpu" and dtype == torch.bfloat16


def fused_usable(x: torch.Tensor) -> bool:
    return fused_for(x.dtype, x.device)


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
    return _ext.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)


def small_m_linear(x, weight, bias):
    return _ext.small_m_linear(x, weight, bias)


def rms_norm_(x, residual, weight, eps):
    _ext.rms_norm_(x, residual, weight, eps)


def rotary_(x, positions, cos, sin):
    _ext.rotary_(x, positions, cos, sin)


def silu_and_mul(x):
    return _ext.silu_and_mul(x)


def sinkhorn_(comb, iters, eps):
    _ext.sinkhorn_(comb, iters, eps)

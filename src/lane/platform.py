"""Device, dtype and threads (seed step 1); attention backend choice (step 3's second layer)."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_fast_bf16() -> bool:
    flags = cpu_flags()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 on CUDA and on CPUs with AVX512-BF16 or AMX, else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if device.type == "cuda" or cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, float32 or bfloat16")
    return _DTYPES[dtype]


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def set_threads(threads: int | None) -> int:
    """Intra-op threads for torch; default: every CPU this process may run on."""
    n = threads or available_cpus()
    if n < 1:
        raise ValueError(f"--threads must be >= 1, got {n}")
    torch.set_num_threads(n)
    return n


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (free RAM that can be had without swapping)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


@dataclass(frozen=True)
class AttentionBackendChoice:
    name: str
    reason: str


def select_attention_backend(hf_config) -> AttentionBackendChoice:
    """Pick the attention backend from the model config's fields, as vllm-ascend's
    platform.py keys it on (use_mla, use_sparse, use_compress)."""
    if getattr(hf_config, "compress_ratios", None) or getattr(hf_config, "compress_rates", None):
        return AttentionBackendChoice("compressed", "config has compress_rates / compress_ratios: sliding window "
                                      "+ compressed (CSA / HCA) layers")
    if getattr(hf_config, "kv_lora_rank", None):
        if getattr(hf_config, "index_topk", None):
            return AttentionBackendChoice("sparse_mla", "config has kv_lora_rank and index_topk")
        return AttentionBackendChoice("mla", "config has kv_lora_rank")
    return AttentionBackendChoice("paged_sdpa", "no kv_lora_rank: dense multi-head attention")

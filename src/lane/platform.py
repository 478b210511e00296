"""Device, dtype and threads (seed step 1); the CPU's kernel path (ISA); the platform,
which chooses each model's attention backend (step 3's second layer)."""
from __future__ import annotations

import ctypes
import functools
import importlib
import logging
import os
import platform as _py_platform
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}

# Kernel paths, narrowest first. avx512 = AVX-512 F/BW/VL/DQ (what oneDNN's bf16 GEMM
# needs); avx2 = AVX2 + FMA + F16C; generic = whatever the compiler makes of plain C++.
CPU_ISAS = ("generic", "avx2", "avx512")
_ISA_NEEDS = {"avx2": ("avx2", "fma3", "f16c"),
              "avx512": ("avx2", "fma3", "f16c", "avx512_f", "avx512_bw", "avx512_vl", "avx512_dq")}
# /proc/cpuinfo's spelling -> cpuinfo's (torch's), for the fallback reader
_PROC_NAMES = {"avx512f": "avx512_f", "avx512bw": "avx512_bw", "avx512vl": "avx512_vl",
               "avx512dq": "avx512_dq", "fma": "fma3"}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as the CPUID instruction reports them (torch's cpuinfo:
    right under emulators and VMs where /proc/cpuinfo shows the host), in cpuinfo's
    spelling (avx512_f, avx512_bf16, amx_bf16, fma3, ...); /proc/cpuinfo otherwise."""
    try:
        caps = torch._C._cpu._get_cpu_capability()
        return frozenset(k for k, v in caps.items() if v is True)
    except Exception:  # a torch without the private query
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(_PROC_NAMES.get(x, x) for x in line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def native_cpu_isa() -> str:
    """The widest kernel path this CPU can run."""
    if _py_platform.machine().lower() not in ("x86_64", "amd64"):
        return "generic"
    flags = cpu_flags()
    for isa in ("avx512", "avx2"):
        if all(f in flags for f in _ISA_NEEDS[isa]):
            return isa
    return "generic"


@functools.cache
def cpu_isa() -> str:
    """The kernel path in use: the CPU's widest, capped by LANE_CPU_ISA=generic|avx2|avx512
    (so one AVX-512 machine can run all three). Caps the compiled kernels, the bf16
    pre-packing and what 'auto' picks."""
    native = native_cpu_isa()
    cap = os.environ.get("LANE_CPU_ISA", "").strip().lower()
    if not cap:
        return native
    if cap not in CPU_ISAS:
        raise ValueError(f"LANE_CPU_ISA={cap!r} is not one of {', '.join(CPU_ISAS)}")
    if CPU_ISAS.index(cap) > CPU_ISAS.index(native):
        logger.warning("LANE_CPU_ISA=%s asks for more than this CPU has; using %s", cap, native)
        return native
    return cap


def cpu_has_fast_bf16() -> bool:
    """bf16 arithmetic in hardware (AVX512-BF16 or AMX), on the avx512 path."""
    flags = cpu_flags()
    return cpu_isa() == "avx512" and ("avx512_bf16" in flags or "amx_bf16" in flags)


def onednn_bf16_gemm() -> bool:
    """Whether oneDNN runs bf16 GEMMs (and so the weight pre-packing) on this CPU: it needs
    AVX-512 BW/VL/DQ or AVX-NE-CONVERT; without them the pre-pack raises."""
    return cpu_isa() == "avx512" or (cpu_isa() == "avx2" and "avx_ne_convert" in cpu_flags())


def default_device() -> torch.device:
    """The CPU, even where torch sees a GPU: lane's CUDA path (the model moved there, its
    kernels) is not built and checked yet, so a GPU box runs lane on its CPU."""
    return torch.device("cpu")


def check_device(name: str | None) -> torch.device:
    """``--device``: None or "auto" and "cpu" are the CPU; any other device is refused by name
    (the KV pools would go there, the model would not)."""
    if name in (None, "auto"):
        return default_device()
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device {name!r} is not a device (lane runs on cpu)") from None
    if device.type != "cpu":
        raise ValueError(f"--device {name}: lane runs on the CPU only for now (its {device.type} path is not "
                         f"built); use --device cpu")
    return device


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """'auto' is bfloat16 on CUDA and on CPUs with AVX512-BF16 or AMX, else float32.
    float16 runs everywhere (fp16 storage; on a CPU, fp32 math)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; choose auto, float32, bfloat16 or float16")
        return dtype
    if dtype is None or dtype == "auto":
        if device.type == "cuda" or cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, float32, bfloat16 or float16")
    return _DTYPES[dtype]


@functools.cache
def libc_madvise():
    """The C library's madvise(addr, length, advice) -> 0, or -1 with ctypes.get_errno() set
    (ctypes lets go of the GIL during the call); None where there is none (not a POSIX libc)."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError, TypeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return madvise


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def disjoint_cpu_sets(n: int) -> list[list[int]] | None:
    """This process's CPUs in ``n`` disjoint equal sets (engine replicas, or a replica's ranks, so
    they do not fight over cores); None with fewer CPUs than sets."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < n:
        return None
    per = len(cpus) // n
    return [cpus[i * per:(i + 1) * per] for i in range(n)]


def set_threads(threads: int | None) -> int:
    """Intra-op threads for torch and the CPU kernels (one OpenMP pool): by default every
    CPU this process may run on, and never more (more threads than cores only contend)."""
    cpus = available_cpus()
    n = threads or cpus
    if n < 1:
        raise ValueError(f"--threads must be >= 1, got {n}")
    if n > cpus:
        logger.warning("--threads %d exceeds the %d CPUs this process may run on; using %d", n, cpus, cpus)
        n = cpus
    torch.set_num_threads(n)
    return n


def parse_cpu_list(text: str) -> list[int]:
    """"0-3,8" -> [0, 1, 2, 3, 8], as taskset and vLLM's VLLM_CPU_OMP_THREADS_BIND write it."""
    cpus: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def thread_binding(threads: int, default: str = "auto") -> list[int] | None:
    """The CPU each OpenMP thread is pinned to (thread i -> result[i]), from
    LANE_CPU_OMP_THREADS_BIND (else ``default``): ``auto`` the first ``threads`` CPUs this process may
    run on, one each; ``nobind`` none (the OS places threads); or a list as "0-3,8" (as many
    CPUs as threads: set --threads to match). A CPU outside the process's set is refused."""
    spec = os.environ.get("LANE_CPU_OMP_THREADS_BIND", default).strip()
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if spec == "nobind" or not allowed:
        return None
    if spec == "auto":
        return allowed[:threads]
    try:
        cpus = parse_cpu_list(spec)
    except ValueError:
        raise ValueError(f"LANE_CPU_OMP_THREADS_BIND={spec!r}: expected auto, nobind or a CPU list as 0-3,8") from None
    outside = sorted(set(cpus) - set(allowed))
    if outside or len(cpus) != threads or len(set(cpus)) != len(cpus):
        raise ValueError(f"LANE_CPU_OMP_THREADS_BIND={spec!r}: needs {threads} distinct CPUs (one per thread; "
                         f"--threads sets how many) of this process's {allowed}"
                         + (f"; {outside} are not" if outside else ""))
    return cpus


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
    backend_cls: str  # "module:Class" of a lane.attention.backends.AttentionBackend
    reason: str

    @property
    def backend(self):
        module, _, qualname = self.backend_cls.partition(":")
        return getattr(importlib.import_module(module), qualname)

    @property
    def name(self) -> str:
        return self.backend.name


_BACKENDS = "lane.attention.backends"


class Platform:
    """What a device kind decides (vLLM's Platform): today, each model's attention
    backend. A ``lane.platform_plugins`` entry may name a subclass that decides otherwise."""
    device_type = "cpu"

    def get_attn_backend(self, hf_config) -> AttentionBackendChoice:
        """From the model config's fields, as vllm-ascend's platform.py keys it
        (use_mla, use_sparse, use_compress)."""
        if getattr(hf_config, "compress_ratios", None) or getattr(hf_config, "compress_rates", None):
            return AttentionBackendChoice(f"{_BACKENDS}:CompressedAttentionBackend",
                                          "config has compress_rates / compress_ratios: sliding window "
                                          "+ compressed (CSA / HCA) layers")
        if getattr(hf_config, "kv_lora_rank", None):
            if getattr(hf_config, "index_topk", None):
                return AttentionBackendChoice(f"{_BACKENDS}:SparseMLABackend", "config has kv_lora_rank and index_topk")
            return AttentionBackendChoice(f"{_BACKENDS}:MLABackend", "config has kv_lora_rank")
        return AttentionBackendChoice(f"{_BACKENDS}:PagedSDPABackend", "no kv_lora_rank: dense multi-head attention")


@functools.cache
def current_platform() -> Platform:
    """The platform plugin's Platform subclass when one is installed and its device is
    present (the first by name, if several), else the built-in one."""
    from lane import plugins

    for name, path in sorted(plugins.load_platform_plugins().items()):
        module, _, qualname = path.partition(":")
        try:
            cls = getattr(importlib.import_module(module), qualname)
        except (ImportError, AttributeError) as e:
            logger.warning("Platform plugin %s: cannot import %s (%s)", name, path, e)
            continue
        if isinstance(cls, type) and issubclass(cls, Platform):
            logger.info("Platform from plugin %s: %s", name, path)
            return cls()
        logger.warning("Platform plugin %s: %s is not a lane.platform.Platform subclass; ignored", name, path)
    return Platform()


def select_attention_backend(hf_config) -> AttentionBackendChoice:
    return current_platform().get_attn_backend(hf_config)

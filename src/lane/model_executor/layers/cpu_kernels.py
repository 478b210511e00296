"""Compiled CPU kernels: plain C++ (no torch headers) behind a small Python module,
built with the system's C++ compiler for the CPU's kernel path (``platform.cpu_isa()``:
generic, avx2 or avx512) on first use, in a few seconds.

Paged decode attention in torch must gather every request's blocks into a padded
copy first; on a CPU that copy costs more than the attention itself. The kernel
reads K/V in place; so does the prefill kernel, where torch would gather a chunk's whole
prefix and repeat it for every GQA head, in every layer. Likewise torch's GEMM for a few rows (decode) reads weights at a
fraction of memory bandwidth; ``small_m_linear`` streams each weight row once.

A build is cached under ``~/.cache/lane/kernels/<isa>-<key>`` (``LANE_KERNEL_CACHE``
moves it), the key hashing the sources, the compiler and its flags, the ISA, the
CPU's feature flags and the Python ABI: a build for one CPU is never loaded on another, and nothing
else (which ninja is on PATH, which checkout) triggers a rebuild. If the build fails
(no compiler), the torch paths run instead, with a warning. ``LANE_CPU_KERNELS=0``
turns the kernels off.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform as _py_platform
import shutil
import subprocess
import sysconfig
import tempfile
import threading
import time

import torch

from lane import platform

logger = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_SOURCES = ("paged_attention.cpp", "prefill_attention.cpp", "gemv.cpp", "elementwise.cpp", "dequant.cpp", "quant_linear.cpp", "module.cpp")
_SOURCE_CFLAGS = {"dequant.cpp": ["-ffp-contract=off"]}  # round as the numpy reference does
_HEADERS = ("common.h",)
# no -ffast-math: its finite-math-only would fold the kernels' -inf checks away
_CFLAGS = ["-O3", "-std=c++17", "-fPIC", "-fopenmp", "-fno-math-errno", "-fno-trapping-math",
           "-fassociative-math", "-fno-signed-zeros", "-freciprocal-math", "-ffp-contract=fast"]
# explicit features, not -march=native: a build is for an ISA, and runs on any CPU that has it
_ISA_CFLAGS = {
    "generic": ["-march=x86-64", "-mtune=generic"],
    "avx2": ["-march=x86-64", "-mavx2", "-mfma", "-mf16c", "-mtune=haswell"],
    "avx512": ["-march=x86-64", "-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl",
               "-mavx512dq", "-mprefer-vector-width=512", "-mtune=skylake-avx512"],
}
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_MODULE = "lane_kernels"
_PY_INCLUDE = sysconfig.get_paths()["include"]
_SO = _MODULE + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")

_lib = None  # the loaded module
_isa: str | None = None
_build_thread: threading.Thread | None = None
_lock = threading.Lock()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _cflags(isa: str) -> list[str]:
    x86 = _py_platform.machine().lower() in ("x86_64", "amd64")
    return _CFLAGS + (_ISA_CFLAGS[isa] if x86 else []) + ["-I" + _PY_INCLUDE]


def build_key(isa: str, cxx: str) -> str:
    """What a build depends on: sources, compiler (path and version), flags, ISA, CPU flags
    and the Python ABI the module is built for."""
    digest = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        with open(os.path.join(_CSRC, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    for part in (os.path.realpath(shutil.which(cxx) or cxx), version, " ".join(_cflags(isa)), str(_SOURCE_CFLAGS), isa,
                 " ".join(sorted(platform.cpu_flags())), _SO):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def cache_root() -> str:
    return os.environ.get("LANE_KERNEL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "lane", "kernels"))


def _compile(isa: str, cxx: str, out_dir: str) -> str:
    """Compile the sources in parallel (one compiler per CPU), link, and move the library
    into place atomically; a second process waits on the lock and finds it built."""
    so = os.path.join(out_dir, _SO)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "build.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(so):
            return so
        t0 = time.perf_counter()
        logger.info("Building the CPU kernels for %s (first use on this CPU; a few seconds)", isa)
        flags = _cflags(isa)
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            objs, procs = [], []
            jobs = max(1, min(len(_SOURCES), platform.available_cpus()))
            for src in _SOURCES:
                obj = os.path.join(tmp, src + ".o")
                objs.append(obj)
                if len(procs) >= jobs:
                    _finish(procs.pop(0))
                procs.append(subprocess.Popen([cxx, *flags, *_SOURCE_CFLAGS.get(src, []), "-c",
                                               os.path.join(_CSRC, src), "-o", obj],
                                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            for p in procs:
                _finish(p)
            tmp_so = os.path.join(tmp, _SO)
            _finish(subprocess.Popen([cxx, "-shared", "-fopenmp", *objs, "-o", tmp_so],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            os.replace(tmp_so, so)
        logger.info("CPU kernels for %s built in %.1f s", isa, time.perf_counter() - t0)
        return so


def _finish(proc: subprocess.Popen) -> None:
    out, _ = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{os.path.basename(proc.args[0])} failed: {out.strip().splitlines()[-1] if out else ''}")


def _build_and_load() -> None:
    global _lib, _isa
    try:
        isa = platform.cpu_isa()
        cxx = _compiler()
        if cxx is None:
            raise RuntimeError("no C++ compiler (c++, g++ or clang++; or set CXX)")
        so = _compile(isa, cxx, os.path.join(cache_root(), f"{isa}-{build_key(isa, cxx)}"))
        loader = importlib.machinery.ExtensionFileLoader(_MODULE, so)
        spec = importlib.util.spec_from_file_location(_MODULE, so, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        _lib, _isa = module, isa
    except Exception as e:  # no compiler, a failed build, ...: the torch paths still work
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        logger.warning("CPU kernels unavailable, using the torch paths (%s)", reason)


def start_build() -> None:
    """Start building (or loading the cached build) in a background thread, so the
    compiler runs while the model loads; ``build()`` waits for it."""
    global _build_thread
    with _lock:
        if _build_thread is None and os.environ.get("LANE_CPU_KERNELS", "1") != "0":
            _build_thread = threading.Thread(target=_build_and_load, name="lane-cpu-kernels", daemon=True)
            _build_thread.start()


def build() -> bool:
    """Build (or load the cached build of) the kernels; True when usable."""
    start_build()
    if _build_thread is not None:
        _build_thread.join()
    return _lib is not None


def available() -> bool:
    return _lib is not None


def isa() -> str | None:
    """The kernel path the loaded build was compiled for."""
    return _isa


def usable(x: torch.Tensor) -> bool:
    return _lib is not None and x.device.type == "cpu" and x.dtype in _DTYPE_CODES


def fused_for(dtype: torch.dtype, device: torch.device) -> bool:
    """The fused element-wise kernels round once where torch rounds after every
    op: used for bf16 only, so float32 stays bit-comparable with HF."""
    return _lib is not None and device.type == "cpu" and dtype == torch.bfloat16


def fused_usable(x: torch.Tensor) -> bool:
    return fused_for(x.dtype, x.device)


# -- the kernels: checks and allocation here; the module takes raw pointers ----------

def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
    """q [B, H, D], caches [blocks, KVH, block_size, D] -> [B, H, D]."""
    B, H, D = q.shape
    KVH, BS = k_cache.shape[1], k_cache.shape[2]
    if D > 1024 or BS > 256:
        raise ValueError(f"paged decode kernel: head_dim {D} > 1024 or block size {BS} > 256")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged decode kernel: the caches must be contiguous")
    q = q.contiguous()
    tables = _as(block_tables, torch.int64)
    lens = _as(context_lens, torch.int32)
    out = torch.empty_like(q)
    _lib.lane_paged_decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                     _DTYPE_CODES[q.dtype], tables.data_ptr(), lens.data_ptr(),
                                     out.data_ptr(), B, H, KVH, D, BS, tables.shape[1], scale,
                                     torch.get_num_threads())
    return out


def prefill_attention(q, k_cache, v_cache, block_ids, num_computed, scale):
    """One request's chunk: q [n, H, D] at positions num_computed .. num_computed + n - 1,
    caches [blocks, KVH, block_size, D] already holding the chunk's K/V, block_ids [>= blocks
    covering num_computed + n] -> [n, H, D], causal over the cached context and the chunk."""
    n, H, D = q.shape
    KVH, BS = k_cache.shape[1], k_cache.shape[2]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.dtype != q.dtype:
        raise ValueError("paged prefill kernel: the caches must be contiguous, of q's dtype")
    if block_ids.numel() * BS < num_computed + n:
        raise ValueError("paged prefill kernel: block_ids do not cover the chunk")
    q = q.contiguous()
    ids = _as(block_ids, torch.int64)
    out = torch.empty_like(q)
    _lib.lane_paged_prefill_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), _DTYPE_CODES[q.dtype],
                                      ids.data_ptr(), num_computed, out.data_ptr(), n, H, KVH, D, BS, scale,
                                      torch.get_num_threads())
    return out


def small_m_linear(x, weight, bias):
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N] in x's dtype; weight contiguous."""
    x = x.contiguous()
    M, K = x.shape
    N = weight.shape[0]
    y = torch.empty(M, N, dtype=x.dtype)
    if bias is not None:
        bias = bias.to(weight.dtype).contiguous()
    _lib.lane_small_m_linear(x.data_ptr(), _DTYPE_CODES[x.dtype], weight.data_ptr(),
                             _DTYPE_CODES[weight.dtype], None if bias is None else bias.data_ptr(),
                             y.data_ptr(), M, N, K, torch.get_num_threads())
    return y


def rms_norm_(x, residual, weight, eps):
    """In place: x = rmsnorm(x + residual) * weight, residual = x + residual (or no residual)."""
    D = x.shape[-1]
    _lib.lane_rms_norm_(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                        _DTYPE_CODES[x.dtype], x.numel() // D, D, eps, torch.get_num_threads())


def rotary_(x, positions, cos, sin):
    """x [T, H, D] (heads contiguous, rows may be strided): rotate-half rope in place."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        raise ValueError("rotary kernel: x must be [T, H, D] with contiguous heads")
    pos = _as(positions, torch.int64)
    _lib.lane_rotary_(x.data_ptr(), _DTYPE_CODES[x.dtype], x.shape[0], x.stride(0), x.shape[1], x.shape[2],
                      pos.data_ptr(), cos.data_ptr(), sin.data_ptr(), cos.shape[1], torch.get_num_threads())


def silu_and_mul(x):
    """x [T, 2I] = [gate | up], contiguous -> silu(gate) * up [T, I]."""
    half = x.shape[1] // 2
    out = torch.empty(x.shape[0], half, dtype=x.dtype)
    _lib.lane_silu_and_mul(x.data_ptr(), out.data_ptr(), _DTYPE_CODES[x.dtype], x.shape[0], half,
                           torch.get_num_threads())
    return out


def sinkhorn_(comb, iters, eps):
    """comb [T, n, n] float32, contiguous: Sinkhorn normalisation in place."""
    _lib.lane_sinkhorn_(comb.data_ptr(), comb.shape[0], comb.shape[1], iters, eps, torch.get_num_threads())



GGML_KINDS = {"Q4_0": (0, 18), "Q4_1": (1, 20), "Q8_0": (2, 34)}  # kernel code, bytes per 32 values


def dequant_ggml(blocks, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """GGUF blocks of kind Q4_0 / Q4_1 / Q8_0 (a contiguous uint8 numpy array: read in
    place, so a read-only mmap will do) -> a flat tensor of dtype."""
    code, size = GGML_KINDS[kind]
    nblocks = blocks.nbytes // size
    out = torch.empty(nblocks * 32, dtype=dtype)
    _lib.lane_dequant_ggml(blocks.ctypes.data, code, nblocks, out.data_ptr(), _DTYPE_CODES[dtype],
                           torch.get_num_threads())
    return out


def quantize_rows_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 32) -> 8-bit blocks: q [M, K] int8, d and s [M, K / 32] fp32
    (s = d * sum of the block's q)."""
    x = x.contiguous()
    M, K = x.shape
    q = torch.empty(M, K, dtype=torch.int8)
    d = torch.empty(M, K // 32)
    s = torch.empty(M, K // 32)
    _lib.lane_quantize_rows_q8(x.data_ptr(), _DTYPE_CODES[x.dtype], q.data_ptr(), d.data_ptr(), s.data_ptr(), M, K)
    return q, d, s


def quant_block_dots(qx: torch.Tensor, blocks: torch.Tensor, kind: str, N: int) -> torch.Tensor:
    """int32 dot products of every input row's and weight row's blocks: [M, N, K / 32]."""
    M, K = qx.shape
    dots = torch.empty(M, N, K // 32, dtype=torch.int32)
    _lib.lane_quant_block_dots(qx.data_ptr(), blocks.data_ptr(), GGML_KINDS[kind][0], dots.data_ptr(), M, N, K)
    return dots


def quant_linear(x: torch.Tensor, blocks: torch.Tensor, kind: str, N: int, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """x [M, K] @ W^T with W [N, K] as GGUF blocks of kind (uint8 [N, K / 32 * block bytes]) -> [M, N]
    in x's dtype. x is quantized to 8-bit blocks once per call."""
    q, d, s = quantize_rows_q8(x)
    M, K = x.shape
    y = torch.empty(M, N, dtype=x.dtype)
    b = None if bias is None else bias.float().contiguous()
    _lib.lane_quant_linear(q.data_ptr(), d.data_ptr(), s.data_ptr(), blocks.data_ptr(), GGML_KINDS[kind][0],
                           None if b is None else b.data_ptr(), y.data_ptr(), _DTYPE_CODES[x.dtype], M, N, K,
                           torch.get_num_threads())
    return y

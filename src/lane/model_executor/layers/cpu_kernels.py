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
import functools
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
# the longest to compile first, so the parallel build ends with the short ones (quant_x8.cpp takes
# a third of the total alone)
_SOURCES = ("quant_x8.cpp", "paged_attention.cpp", "bf16_amx.cpp", "paged_attention_amx.cpp", "int8_linear.cpp", "kquant.cpp", "prefill_attention.cpp",
            "gemv.cpp", "elementwise.cpp", "shm_comm.cpp", "quant_linear.cpp", "module.cpp", "dequant.cpp", "decode_layers.cpp",
            "threads.cpp")
# round as the numpy reference does
_SOURCE_CFLAGS = {"dequant.cpp": ["-ffp-contract=off"], "kquant.cpp": ["-ffp-contract=off"],
                  # one order of each row's sums, whichever caller inlined them (batch invariance)
                  "paged_attention_amx.cpp": ["-fno-associative-math", "-fno-reciprocal-math", "-ffp-contract=off"]}
_HEADERS = ("common.h", "amx.h", "kquant_avx512.inc", "quant_x8_amx.inc")
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

# One code path and one reduction order per row, whatever the batch (LANE_BATCH_INVARIANT=0:
# the faster-per-shape paths that change with M: oneDNN / MKL GEMMs for many rows, GGUF
# weights dequantized for prefill, the flash prefill attention). With it on, a request's
# greedy tokens do not depend on what else is in its batch, on chunking, on prefix-cache hits
# or on preemption: a row of a prefill chunk is computed as the same row of a decode step.
BATCH_INVARIANT = os.environ.get("LANE_BATCH_INVARIANT", "1") != "0"
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
                while len(procs) >= jobs:  # the next unit starts when any running one ends
                    done = next((p for p in procs if p.poll() is not None), None)
                    if done is None:
                        time.sleep(0.02)
                        continue
                    procs.remove(done)
                    _finish(done)
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


def native():
    """The loaded module itself (None until built), for code outside the layers that calls its
    functions directly: the shared-memory collectives."""
    return _lib


def isa() -> str | None:
    """The kernel path the loaded build was compiled for."""
    return _isa


def usable(x: torch.Tensor) -> bool:
    return _lib is not None and x.device.type == "cpu" and x.dtype in _DTYPE_CODES


def dtype_code(dtype: torch.dtype) -> int | None:
    """The kernels' code for a dtype (float32, bfloat16, float16), or None for one they do not run."""
    return _DTYPE_CODES.get(dtype)


def fused_for(dtype: torch.dtype, device: torch.device, float32: bool = False) -> bool:
    """The fused element-wise kernels round once where torch rounds after every
    op: used for bf16, and for float32 where the caller asks (``float32``: a model whose
    linears are GGUF blocks, so its prefill rows run what its fused decode step runs); dense
    float32 stays bit-comparable with HF."""
    return _lib is not None and device.type == "cpu" and (
        dtype == torch.bfloat16 or (float32 and dtype == torch.float32))


def fused_usable(x: torch.Tensor, float32: bool = False) -> bool:
    return fused_for(x.dtype, x.device, float32)


# -- the kernels: checks and allocation here; the module takes raw pointers ----------

def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype and t.is_contiguous() else t.to(dtype).contiguous()


def decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
    """q [B, H, D], caches [blocks, KVH, block_size, D] -> [B, H, D]. block_tables [B, max
    blocks], or one table [max blocks] that every row reads (rows of one request)."""
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
                                     out.data_ptr(), B, H, KVH, D, BS, tables.shape[1] if tables.dim() == 2 else 0,
                                     scale, torch.get_num_threads())
    return out


@functools.cache
def fp8_e4m3_table() -> torch.Tensor:
    """The 256 float8 e4m3fn bytes as float32 (the 8-bit cache's fp8 decode table)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def decode_attention_8bit(q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, scale, fp8: bool):
    """decode_attention over an 8-bit cache (C8): k/v_cache int8 or uint8 (fp8 e4m3 bytes)
    [blocks, KVH, block_size, D], their float32 scales [blocks, KVH, block_size]; each row
    dequantized as the kernel reads it."""
    B, H, D = q.shape
    KVH, BS = k_cache.shape[1], k_cache.shape[2]
    if D > 1024 or BS > 256:
        raise ValueError(f"paged decode kernel: head_dim {D} > 1024 or block size {BS} > 256")
    q = q.contiguous()
    tables = _as(block_tables, torch.int64)
    lens = _as(context_lens, torch.int32)
    out = torch.empty_like(q)
    _lib.lane_paged_decode_attention_q8(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_scale.data_ptr(),
                                        v_scale.data_ptr(), fp8_e4m3_table().data_ptr(), int(fp8),
                                        _DTYPE_CODES[q.dtype], tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
                                        B, H, KVH, D, BS, tables.shape[1] if tables.dim() == 2 else 0, scale,
                                        torch.get_num_threads())
    return out


def cache_write_8bit(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping, fp8: bool):
    """cache_write into an 8-bit cache: each (token, head) row quantized with its own scale
    (absmax / 127 for int8, absmax / 448 for fp8 e4m3)."""
    T, KVH, D = k.shape
    if k.stride(2) != 1 or k.stride(1) != D or v.stride(2) != 1 or v.stride(1) != D:
        k, v = k.contiguous(), v.contiguous()
    slots = _as(slot_mapping, torch.int64)
    _lib.lane_cache_write_q8(k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k_cache.data_ptr(),
                             v_cache.data_ptr(), k_scale.data_ptr(), v_scale.data_ptr(), slots.data_ptr(),
                             _DTYPE_CODES[k.dtype], int(fp8), T, KVH, D, k_cache.shape[2])


def check_chunk_blocks(block_ids: torch.Tensor, block_size: int, num_computed: int, rows: int) -> None:
    """A ValueError unless a chunk's block ids hold its cached tokens and its own rows."""
    if block_ids.numel() * block_size < num_computed + rows:
        raise ValueError("paged prefill: block_ids do not cover the chunk")


def prefill_rows_attention(q, k_cache, v_cache, block_ids, num_computed, scale):
    """One request's chunk (q [n, H, D] at positions num_computed ..), each row attended
    exactly as decode_attention attends a decode row at that position (the batch-invariant
    prefill: a row's result does not depend on the chunk it came in)."""
    n = q.shape[0]
    check_chunk_blocks(block_ids, k_cache.shape[2], num_computed, n)
    lens = torch.arange(num_computed + 1, num_computed + n + 1, dtype=torch.int32)
    return decode_attention(q, k_cache, v_cache, block_ids.reshape(-1), lens, scale)


def cache_write(k, v, k_cache, v_cache, slot_mapping):
    """k, v [T, KVH, D] (heads contiguous, rows may be strided) into their slots of the caches
    [blocks, KVH, block_size, D] (of k's dtype); slot_mapping [T] int64: block * block_size + offset."""
    T, KVH, D = k.shape
    if k.stride(2) != 1 or k.stride(1) != D or v.stride(2) != 1 or v.stride(1) != D:
        k, v = k.contiguous(), v.contiguous()
    slots = _as(slot_mapping, torch.int64)
    _lib.lane_cache_write(k.data_ptr(), v.data_ptr(), k.stride(0), v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                          slots.data_ptr(), _DTYPE_CODES[k.dtype], T, KVH, D, k_cache.shape[2])


def llama_decode_layers(model_rec, layer_recs, x, residual, positions, slots, block_tables, context_lens, spans,
                        eps, scale, times=None):
    """Every layer of a Llama-family step of decodes and prefill chunks (models/llama_decode.py
    builds the int64 records): x [T, hidden] contiguous, the embeddings in and the last layer's
    output out, in place; residual [T, hidden] written; positions / slots [T] int64. The first
    B = len(context_lens) rows are decodes: block_tables [B, max blocks] int64, context_lens [B]
    int32, contiguous; the rest are chunks: spans [S, 4] int64 (first row, rows, tokens already
    cached, the data_ptr of the request's int64 block ids), in row order. times: None or float64
    [6], the pieces' seconds."""
    _lib.lane_llama_decode_layers(model_rec.data_ptr(), layer_recs.data_ptr(), x.data_ptr(), residual.data_ptr(),
                                  _DTYPE_CODES[x.dtype], positions.data_ptr(), slots.data_ptr(),
                                  block_tables.data_ptr(), context_lens.data_ptr(), context_lens.shape[0],
                                  block_tables.shape[1], spans.data_ptr(), spans.shape[0], x.shape[0], eps, scale,
                                  None if times is None else times.data_ptr(), torch.get_num_threads())


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


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a 2-D CPU tensor (first NaN, else first maximum) as int64;
    torch's where the kernels are not built or x is not one of their dtypes."""
    if not usable(x) or x.dim() != 2:
        return x.argmax(dim=-1)
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _lib.lane_argmax_rows(x.data_ptr(), _DTYPE_CODES[x.dtype], out.data_ptr(), x.shape[0], x.shape[1],
                          torch.get_num_threads())
    return out


def sinkhorn_(comb, iters, eps):
    """comb [T, n, n] float32, contiguous: Sinkhorn normalisation in place."""
    _lib.lane_sinkhorn_(comb.data_ptr(), comb.shape[0], comb.shape[1], iters, eps, torch.get_num_threads())



# GGUF kinds the kernels run: kernel code, values per block, bytes per block. The
# 32-value kinds run in quant_linear.cpp, the K-quants (super-blocks of 256) in kquant.cpp.
GGML_KINDS = {"Q4_0": (0, 32, 18), "Q4_1": (1, 32, 20), "Q8_0": (2, 32, 34),
              "Q4_K": (3, 256, 144), "Q5_K": (4, 256, 176), "Q6_K": (5, 256, 210)}
K_KINDS = ("Q4_K", "Q5_K", "Q6_K")


def dequant_ggml(blocks, kind: str, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """GGUF blocks of a kind in GGML_KINDS (a contiguous uint8 numpy array: read in place, so a
    read-only mmap will do) -> a flat tensor of dtype (into ``out`` if given)."""
    code, values, size = GGML_KINDS[kind]
    nblocks = blocks.nbytes // size
    if out is None:
        out = torch.empty(nblocks * values, dtype=dtype)
    elif out.numel() != nblocks * values or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"dequant_ggml: out must be {nblocks * values} contiguous {dtype}")
    fn = _lib.lane_dequant_kquant if kind in K_KINDS else _lib.lane_dequant_ggml
    fn(blocks.ctypes.data, code, nblocks, out.data_ptr(), _DTYPE_CODES[dtype], torch.get_num_threads())
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


def quantize_rows_q8k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (K a multiple of 256) -> ggml's Q8_K: q [M, K] int8, d [M, K / 256] fp32
    (max|x| / 127), bsum [M, K / 16] int16 (sums of q per 16)."""
    x = x.contiguous()
    M, K = x.shape
    q = torch.empty(M, K, dtype=torch.int8)
    d = torch.empty(M, K // 256)
    bsum = torch.empty(M, K // 16, dtype=torch.int16)
    _lib.lane_quantize_rows_q8k(x.data_ptr(), _DTYPE_CODES[x.dtype], q.data_ptr(), d.data_ptr(), bsum.data_ptr(),
                                M, K)
    return q, d, bsum


def quant_block_dots(qx: torch.Tensor, blocks: torch.Tensor, kind: str, N: int) -> torch.Tensor:
    """int32 dot products of every input row's and weight row's blocks: [M, N, K / 32]; for
    the K-quants (qx from quantize_rows_q8k) per sub-block, [M, N, K / 32] (Q4_K, Q5_K: the
    unsigned quants) or [M, N, K / 16] (Q6_K: quants - 32)."""
    M, K = qx.shape
    sub = 16 if kind == "Q6_K" else 32
    dots = torch.empty(M, N, K // sub, dtype=torch.int32)
    fn = _lib.lane_kquant_sub_dots if kind in K_KINDS else _lib.lane_quant_block_dots
    fn(qx.data_ptr(), blocks.data_ptr(), GGML_KINDS[kind][0], dots.data_ptr(), M, N, K)
    return dots


@functools.cache
def x8_kinds() -> tuple[str, ...]:
    """Kinds with a repacked layout, 8 rows interleaved (quant_x8.cpp): Q4_0, Q4_1, Q8_0, and
    the K-quants where their kernel runs (AVX-512 VNNI); elsewhere they keep kquant.cpp's."""
    ok = torch.zeros(1, dtype=torch.int32)
    kinds = []
    for kind in ("Q4_0", "Q4_1", "Q8_0", *K_KINDS):
        _lib.lane_x8_supports(GGML_KINDS[kind][0], ok.data_ptr())
        if ok.item():
            kinds.append(kind)
    return tuple(kinds)


def x8_amx(enable: bool | None = None, min_rows: int | None = None) -> tuple[bool, int]:
    """Whether the x8 kernels run M >= min_rows on AMX int8 tiles here (the CPU has AMX-INT8 and
    the kernel granted the tile state; LANE_CPU_AMX=0 turns it off), and that min_rows. With
    ``enable`` / ``min_rows``, set them first (tests and benchmarks: the tiles give the pair
    kernel's rows bit for bit, so switching changes speed only)."""
    if _lib is None:
        return False, 0
    out = torch.zeros(2, dtype=torch.int64)
    _lib.lane_x8_amx(-1 if enable is None else int(enable), min_rows or 0, out.data_ptr())
    return bool(out[0]), int(out[1])


def bf16_amx(enable: bool | None = None) -> bool:
    """Whether dense bf16 layers (small_m_linear with bf16 rows and weight) run on AMX-BF16
    tiles here, for every M (the CPU has AMX-BF16 and the tile state; LANE_CPU_AMX=0 turns it
    off). With ``enable``, set it first: benchmarks only, as the tiles' sums differ from the
    FMA kernel's and a switch mid-run breaks batch invariance."""
    return _amx_switch("lane_bf16_amx", enable)


def x8_bf16_amx(enable: bool | None = None) -> bool:
    """Whether bf16 rows on x8-layout Q4_0 / Q4_1 weights run on AMX-BF16 tiles here, each unit
    of weight rows dequantized to bf16 per call, for every M (the CPU has AMX-BF16 and VBMI; off
    with LANE_CPU_AMX=0 or LANE_CPU_X8_BF16=0). With ``enable``, set it first: tests and
    benchmarks only, as the int8 kernels that run those rows otherwise sum differently, and a
    switch mid-run breaks batch invariance (quant_linear's ``int8`` asks for those per call)."""
    return _amx_switch("lane_x8_bf16_amx", enable)


def attention_amx(enable: bool | None = None) -> bool:
    """Whether paged attention over a bf16 cache (decode rows and the batch-invariant prefill's
    rows alike) runs on AMX-BF16 tiles here: the CPU has AMX-BF16 and the model's shape takes
    them (head_dim 64 or 128, 16-token blocks, at most 16 query heads per KV head). With
    ``enable``, set it first: benchmarks only, as a switch mid-run breaks batch invariance."""
    return _amx_switch("lane_attention_amx", enable)


def attention_dpbf16(enable: bool | None = None) -> bool:
    """Whether paged attention over a bf16 cache, where the AMX tiles do not take it, runs the
    AVX512-BF16 kernel here (the CPU has AVX512-BF16: vdpbf16ps on K in place and on V in pairs
    of keys) rather than the fp32 one. ``enable``: as attention_amx's."""
    return _amx_switch("lane_attention_dpbf16", enable)


def _amx_switch(name: str, enable: bool | None) -> bool:
    """A kernel's switch (lane_bf16_amx, lane_attention_amx, lane_attention_dpbf16): set it
    (enable not None), then whether that kernel runs here."""
    if _lib is None:
        return False
    out = torch.zeros(1, dtype=torch.int64)
    getattr(_lib, name)(-1 if enable is None else int(enable), out.data_ptr())
    return bool(out[0])


def gguf_kernels(dtype: torch.dtype) -> str:
    """Which kernels multiply a GGUF's blocks kept under --quantization auto on this CPU, with rows
    of ``dtype`` (for `lane explain`); the same for every row count (batch invariance)."""
    if _lib is None:
        return "none: the CPU kernels are unavailable here (no compiler or a failed build); load with --quantization none"
    # (the K-quants take the x8 layout exactly where the kernels run VNNI: lane_x8_supports)
    ints = f"the int8 kernels (8-bit activations; {_isa} build" + (", VNNI" if "Q4_K" in x8_kinds() else "") + ")"
    amx, min_rows = x8_amx()
    if amx:
        ints += f", AMX-INT8 tiles from {min_rows} rows"
    if dtype == torch.bfloat16 and x8_bf16_amx():
        return (f"Q4_0 / Q4_1: AMX-BF16 tiles, each unit of weight rows dequantized to bf16 per call; "
                f"Q8_0, K-quants and MoE experts: {ints}")
    return ints


def x8_fits(kind: str, N: int) -> bool:
    """Whether repack_x8 takes N rows of this kind: a kind in x8_kinds() and N a multiple of 8."""
    return _lib is not None and N % 8 == 0 and kind in x8_kinds()


def repack_x8(blocks: torch.Tensor, kind: str, N: int) -> torch.Tensor | None:
    """GGUF blocks [N, row bytes] of a kind in x8_kinds() -> the same bytes with each group of 8
    rows interleaved, which quant_linear(..., x8=True) runs; None where they do not fit it
    (x8_fits)."""
    if not x8_fits(kind, N):
        return None
    blocks = blocks.contiguous()
    out = torch.empty_like(blocks)
    K = blocks.shape[1] // GGML_KINDS[kind][2] * GGML_KINDS[kind][1]
    _lib.lane_repack_x8(blocks.data_ptr(), GGML_KINDS[kind][0], out.data_ptr(), N, K)
    return out


def dequant_x8(packed: torch.Tensor, kind: str, N: int, K: int, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """repack_x8's layout -> the weight [N, K] as dtype, as dequant_ggml rounds it (into ``out``)."""
    if out is None:
        out = torch.empty(N * K, dtype=dtype)
    _lib.lane_dequant_ggml_x8(packed.data_ptr(), GGML_KINDS[kind][0], N, K, out.data_ptr(), _DTYPE_CODES[dtype],
                              torch.get_num_threads())
    return out.view(N, K)


def dequant_x8_rows(packed: torch.Tensor, kind: str, ids: torch.Tensor, K: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of repack_x8's layout as dtype [len(ids), K] (an embedding's lookup)."""
    ids = _as(ids.reshape(-1), torch.int64)
    out = torch.empty(ids.numel(), K, dtype=dtype)
    _lib.lane_dequant_x8_rows(packed.data_ptr(), GGML_KINDS[kind][0], ids.data_ptr(), ids.numel(), K,
                              out.data_ptr(), _DTYPE_CODES[dtype])
    return out


def quant_x8_block_dots(qx: torch.Tensor, packed: torch.Tensor, kind: str, N: int) -> torch.Tensor:
    """As quant_block_dots, from repack_x8's layout as its kernel computes them: [M, N, K / 32]
    (the 32-block kinds)."""
    if kind in K_KINDS:
        raise ValueError(f"quant_x8_block_dots: {kind} has no block dots here")
    M, K = qx.shape
    dots = torch.empty(M, N, K // 32, dtype=torch.int32)
    _lib.lane_quant_x8_block_dots(qx.data_ptr(), packed.data_ptr(), GGML_KINDS[kind][0], dots.data_ptr(), M, N, K)
    return dots


def quant_linear(x: torch.Tensor, blocks: torch.Tensor, kind: str, N: int, bias: torch.Tensor | None = None,
                 x8: bool = False, int8: bool = False) -> torch.Tensor:
    """x [M, K] @ W^T with W [N, K] as GGUF blocks of kind (uint8 [N, K / block values * block
    bytes]; with ``x8``, in repack_x8's layout) -> [M, N] in x's dtype. The kernel quantizes x
    to 8-bit blocks once per call (Q8_K for the K-quants); bf16 rows on x8 Q4_0 / Q4_1 take the
    dequantizing bf16 tiles where x8_bf16_amx() says so, unless ``int8`` (a layer's choice,
    never a row count's: an MoE expert, which mostly sees a row or two)."""
    x = x.contiguous()
    M, K = x.shape
    y = torch.empty(M, N, dtype=x.dtype)
    fn = (_lib.lane_quant_x8_linear_int8 if int8 else _lib.lane_quant_x8_linear) if x8 else \
        _lib.lane_kquant_linear if kind in K_KINDS else _lib.lane_quant_linear
    dt, b = _DTYPE_CODES[x.dtype], _bias_f32(bias)
    fn(x.data_ptr(), dt, blocks.data_ptr(), GGML_KINDS[kind][0], None if b is None else b.data_ptr(),
       y.data_ptr(), dt, M, N, K, torch.get_num_threads())
    return y


def x8_silu_mul(x: torch.Tensor, packed: torch.Tensor, kind: str, inter: int,
                bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """silu(x Wg^T) * (x Wu^T) [M, inter] for bf16 rows x on a gate_up layer W = [Wg; Wu] in
    repack_x8's layout, in one pass on the dequantizing bf16 tiles (the fused decode step's MLP):
    None where those tiles do not run it (then quant_linear and silu_and_mul, the same bits)."""
    if x.dtype != torch.bfloat16:
        return None
    x = x.contiguous()
    out = torch.empty(x.shape[0], inter, dtype=torch.bfloat16)
    done = torch.zeros(1, dtype=torch.int64)
    b = _bias_f32(bias)
    _lib.lane_x8_silu_mul(x.data_ptr(), packed.data_ptr(), GGML_KINDS[kind][0], None if b is None else b.data_ptr(),
                          out.data_ptr(), x.shape[0], inter, x.shape[1], torch.get_num_threads(), done.data_ptr())
    return out if done.item() else None


def bind_threads(cpus: list[int]) -> None:
    """Pin OpenMP thread i (torch's pool and the kernels') to ``cpus[i]``; the caller, thread 0,
    is pinned to ``cpus[0]``. Threads it starts later inherit that one CPU: bind after loading."""
    ids = torch.tensor(cpus, dtype=torch.int32)
    failed = torch.zeros(1, dtype=torch.int32)
    _lib.lane_bind_threads(ids.data_ptr(), len(cpus), failed.data_ptr())
    if int(failed):
        raise OSError(f"could not bind {int(failed)} of {len(cpus)} threads to CPUs {cpus}")


# -- int8 weights, one fp32 scale per output channel (--quantization int8 / w8a8) ----------
# qw int8 [N, K] and sw fp32 [N] contiguous. Up to INT8_SMALL_M rows (decode, verify) run the
# C++ kernels, which stream each weight row once; more rows (prefill) run torch's GEMMs:
# torch._int_mm for W8A8, a dequantized weight for W8A16. Without the kernels, torch only.

INT8_SMALL_M = 16
# W8A8 rows up to which the kernel beats torch._int_mm; None: 16, but 8 where oneDNN's _int_mm
# has AMX int8 tiles (measured on SmolLM2's shapes, weights in cache)
W8A8_SMALL_M: int | None = None


def _w8a8_small_m() -> int:
    if W8A8_SMALL_M is not None:
        return W8A8_SMALL_M
    return 8 if "amx_int8" in platform.cpu_flags() else INT8_SMALL_M


def quantize_weight_int8(w: torch.Tensor, rows: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (qw int8 [N, K], sw fp32 [N]): symmetric per output channel,
    sw = max|w_row| / 127, qw = round(w / sw) (a zero row: sw = 0, qw = 0). In chunks of
    ``rows`` rows, so a large weight needs no whole fp32 copy."""
    N, K = w.shape
    qw = torch.empty(N, K, dtype=torch.int8)
    sw = torch.empty(N, dtype=torch.float32)
    for i in range(0, N, rows):
        c = w[i:i + rows].float()
        s = c.abs().amax(dim=1) / 127
        qw[i:i + rows] = torch.round(c / torch.where(s > 0, s, 1)[:, None]).clamp_(-127, 127).to(torch.int8)
        sw[i:i + rows] = s
    return qw, sw


def int8_weight_sums(qw: torch.Tensor) -> torch.Tensor:
    """Row sums of qw [N, K] as int32 [N]: the VNNI kernel's correction for feeding x as x + 128
    (compute once at load and pass as wsum)."""
    return qw.sum(dim=1, dtype=torch.int32)


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 / bf16 / fp16 -> (qx int8 [M, K], sx fp32 [M]): symmetric per row,
    sx = max|x_row| / 127, qx = round(x / sx) (rounded as x * (127 / max|x_row|))."""
    M, K = x.shape
    if _lib is None or x.dtype not in _DTYPE_CODES:
        return quantize_weight_int8(x)  # the same per-row definition, in torch
    x = x.contiguous()
    qx = torch.empty(M, K, dtype=torch.int8)
    sx = torch.empty(M, dtype=torch.float32)
    _lib.lane_quantize_per_token_int8(x.data_ptr(), _DTYPE_CODES[x.dtype], qx.data_ptr(), sx.data_ptr(), M, K,
                                      torch.get_num_threads())
    return qx, sx


def _bias_f32(bias):
    return None if bias is None else bias.to(torch.float32).contiguous()


def int8_w8a8_dots(qx: torch.Tensor, qw: torch.Tensor, wsum: torch.Tensor | None = None) -> torch.Tensor:
    """The int32 dot products qx [M, K] . qw [N, K]^T -> [M, N] that int8_linear_w8a8 scales
    (the tests' hook): the kernel for M <= INT8_SMALL_M (the VNNI path when wsum is given and the
    CPU has it, else maddubs / generic), torch._int_mm above."""
    M, K = qx.shape
    N = qw.shape[0]
    if _lib is None or M > INT8_SMALL_M:
        return torch._int_mm(qx, qw.t())
    dots = torch.empty(M, N, dtype=torch.int32)
    _lib.lane_int8_w8a8(qx.data_ptr(), None, qw.data_ptr(), None, None if wsum is None else wsum.data_ptr(),
                        None, dots.data_ptr(), None, 0, M, N, K, torch.get_num_threads())
    return dots


def int8_linear_w8a8(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None = None,
                     wsum: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ (qw * sw)^T (+ bias) -> [M, N] in x's dtype, x quantized per row to int8
    (quantize_per_token_int8) and int32 dot products: y = sx * sw * dot + bias. wsum
    (int8_weight_sums(qw), made at load) lets the VNNI path run; without it, it is made here."""
    M, K = x.shape
    N = qw.shape[0]
    qx, sx = quantize_per_token_int8(x)
    b = _bias_f32(bias)
    if _lib is None:
        y = torch._int_mm(qx, qw.t()).float() * sx[:, None] * sw
        return (y if b is None else y + b).to(x.dtype)
    dtype = x.dtype if x.dtype in _DTYPE_CODES else torch.float32
    y = torch.empty(M, N, dtype=dtype)
    threads = torch.get_num_threads()
    if M <= _w8a8_small_m():
        if wsum is None:
            wsum = int8_weight_sums(qw)
        _lib.lane_int8_w8a8(qx.data_ptr(), sx.data_ptr(), qw.data_ptr(), sw.data_ptr(), wsum.data_ptr(),
                            None if b is None else b.data_ptr(), None, y.data_ptr(), _DTYPE_CODES[dtype], M, N, K,
                            threads)
    else:
        dots = torch._int_mm(qx, qw.t())
        _lib.lane_int8_scale(dots.data_ptr(), sx.data_ptr(), sw.data_ptr(), None if b is None else b.data_ptr(),
                             y.data_ptr(), _DTYPE_CODES[dtype], M, N, threads)
    return y.to(x.dtype)


def int8_linear_w8a16(x: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """x [M, K] @ (qw * sw)^T (+ bias) -> [M, N] in x's dtype, x kept in floating point (fp32
    arithmetic): y = (x . qw^T) * sw + bias."""
    M, K = x.shape
    N = qw.shape[0]
    b = _bias_f32(bias)
    if usable(x) and M <= INT8_SMALL_M:
        x = x.contiguous()
        y = torch.empty(M, N, dtype=x.dtype)
        _lib.lane_int8_w8a16(x.data_ptr(), _DTYPE_CODES[x.dtype], qw.data_ptr(), sw.data_ptr(),
                             None if b is None else b.data_ptr(), y.data_ptr(), M, N, K, torch.get_num_threads())
        return y
    # large M: torch's GEMM over the weight dequantized tile by tile (at most ~8 MiB at a time).
    # bf16 with AMX / AVX512-BF16: a bf16 GEMM on the integers (exact in bf16), scaled in fp32
    # after; otherwise fp32, the scale folded into the weight tile.
    exact_ints = x.dtype == torch.bfloat16 and platform.cpu_has_fast_bf16()
    gdtype = torch.bfloat16 if exact_ints else torch.float32
    xg = x.to(gdtype)
    rows = max(1, (8 << 20) // (K * gdtype.itemsize))
    y = torch.empty(M, N, dtype=gdtype)
    for n0 in range(0, N, rows):
        n1 = min(N, n0 + rows)
        w = _dequant_int8(qw, None if exact_ints else sw, gdtype, n0, n1)
        if n1 - n0 == N:
            y = torch.nn.functional.linear(xg, w, None if exact_ints else b)
        else:
            y[:, n0:n1] = torch.nn.functional.linear(xg, w, None if exact_ints or b is None else b[n0:n1])
    if exact_ints:
        y = y.float() * sw if b is None else torch.addcmul(b, y.float(), sw)
    return y.to(x.dtype)


def _dequant_int8(qw, sw, dtype, n0, n1):
    """Rows [n0, n1) of qw as dtype, times sw unless sw is None."""
    K = qw.shape[1]
    if _lib is None:
        w = qw[n0:n1].to(dtype)
        return w if sw is None else (w * sw[n0:n1, None]).to(dtype)
    out = torch.empty(n1 - n0, K, dtype=dtype)
    _lib.lane_int8_dequant(qw.data_ptr(), None if sw is None else sw.data_ptr(), out.data_ptr(), _DTYPE_CODES[dtype],
                           n0, n1, K, torch.get_num_threads())
    return out

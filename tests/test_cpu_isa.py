"""Every dtype on every x86 kernel path. LANE_CPU_ISA caps the compiled kernels, the
bf16 pre-packing and what 'auto' picks, so this machine runs each path it has: an
AVX-512 one all three, an AVX2 one two. The kernel cache is keyed by what a build
depends on, and no build tool on PATH changes it."""
import json
import os
import subprocess
import sys

import pytest

from lane import platform
from lane.model_executor.layers import cpu_kernels

PATHS = [isa for isa in platform.CPU_ISAS
         if platform.CPU_ISAS.index(isa) <= platform.CPU_ISAS.index(platform.native_cpu_isa())]

RUN = """
import json, sys
from lane import LLM, SamplingParams, platform
from lane.model_executor.layers import cpu_kernels
runs = {}
for dtype in ("auto", "float32", "bfloat16", "float16"):
    llm = LLM(sys.argv[1], dtype=dtype, kv_cache_memory_bytes=16 << 20, show_progress=False)
    ps = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 20, 45)]
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    runs[dtype] = dict(dtype=str(llm.config.model_config.dtype), packed=llm.engine.worker.num_packed,
                       tokens=[o.outputs[0].token_ids for o in outs])
print(json.dumps(dict(isa=platform.cpu_isa(), kernels=cpu_kernels.isa(), runs=runs)))
"""


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, smollm_tokenizer):
    from conftest import make_tiny_checkpoint

    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("isa") / "m", smollm_tokenizer)


def run_capped(code: str, isa: str | None, *args: str, **env) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", **env}
    full_env.pop("LANE_CPU_ISA", None)
    if isa is not None:
        full_env["LANE_CPU_ISA"] = isa
    return subprocess.run([sys.executable, "-c", code, *args], env=full_env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def runs_by_isa(tiny_llama):
    out = {}
    for isa in PATHS:
        r = run_capped(RUN, isa, tiny_llama)
        assert r.returncode == 0, r.stderr[-3000:]
        out[isa] = json.loads(r.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("isa", PATHS)
def test_every_dtype_runs_on_every_kernel_path(runs_by_isa, isa):
    res = runs_by_isa[isa]
    assert res["isa"] == isa and res["kernels"] == isa  # the build is the capped path's
    runs = res["runs"]
    for dtype, run in runs.items():
        assert all(len(t) == 10 for t in run["tokens"]), dtype
    assert runs["float16"]["dtype"] == "torch.float16" and runs["bfloat16"]["dtype"] == "torch.bfloat16"
    flags = platform.cpu_flags()
    fast_bf16 = isa == "avx512" and ("avx512_bf16" in flags or "amx_bf16" in flags)
    # auto: the fastest dtype of the path at hand
    assert runs["auto"]["dtype"] == ("torch.bfloat16" if fast_bf16 else "torch.float32")
    # batch-invariant (the default): every M runs lane's dense kernel on the weight as it is, so
    # nothing is pre-packed for oneDNN on any path
    assert runs["bfloat16"]["packed"] == runs["float32"]["packed"] == runs["float16"]["packed"] == 0


def test_float32_tokens_agree_across_kernel_paths(runs_by_isa):
    """The paths differ only in vector width: greedy float32 tokens are the same."""
    tokens = {isa: res["runs"]["float32"]["tokens"] for isa, res in runs_by_isa.items()}
    assert len({json.dumps(t) for t in tokens.values()}) == 1, tokens


def test_bad_isa_cap_is_refused_by_name(tiny_llama):
    r = run_capped("from lane import LLM; import sys; LLM(sys.argv[1], show_progress=False)", "sse9", tiny_llama)
    assert r.returncode != 0 and "LANE_CPU_ISA='sse9' is not one of generic, avx2, avx512" in r.stderr
    cli = subprocess.run([sys.executable, "-m", "lane.entrypoints.cli", "generate", "--model", tiny_llama,
                          "--max-tokens", "2", "Hi"], env={**os.environ, "LANE_CPU_ISA": "sse9"},
                         capture_output=True, text=True, timeout=300)
    assert cli.returncode != 0 and "LANE_CPU_ISA='sse9'" in cli.stderr and "Traceback" not in cli.stderr


def test_build_key_names_what_a_build_depends_on():
    cxx = cpu_kernels._compiler()
    keys = {isa: cpu_kernels.build_key(isa, cxx) for isa in platform.CPU_ISAS}
    assert len(set(keys.values())) == 3  # one build per kernel path
    for isa, key in keys.items():
        assert cpu_kernels.build_key(isa, cxx) == key  # stable
    flags = list(cpu_kernels._CFLAGS)
    try:  # compiler flags are part of the key ...
        cpu_kernels._CFLAGS.append("-fno-unroll-loops")
        assert cpu_kernels.build_key("avx2", cxx) != keys["avx2"]
    finally:
        cpu_kernels._CFLAGS[:] = flags
    saved = platform.cpu_flags
    try:  # ... and so are the CPU's feature flags: a build is never loaded on another CPU
        platform.cpu_flags = lambda: saved() - {"avx2"}
        assert cpu_kernels.build_key("avx2", cxx) != keys["avx2"]
    finally:
        platform.cpu_flags = saved


def test_kernel_cache_survives_another_build_tool_on_path(tmp_path):
    """The build runs the compiler itself (no ninja): a different (here: broken) ninja
    first on PATH neither breaks it nor rebuilds a cached one."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ninja = bin_dir / "ninja"
    ninja.write_text("#!/bin/sh\necho 'not this ninja' >&2\nexit 1\n")
    ninja.chmod(0o755)
    code = ("from lane.model_executor.layers import cpu_kernels as k\n"
            "import glob, os\nassert k.build()\n"
            "so = glob.glob(os.path.join(k.cache_root(), '*', 'lane_kernels*'))\n"
            "print(len(so), os.stat(so[0]).st_mtime_ns)")
    env = {"LANE_KERNEL_CACHE": str(tmp_path / "cache")}
    first = run_capped(code, "generic", **env)
    assert first.returncode == 0, first.stderr[-2000:]
    second = run_capped(code, "generic", PATH=f"{bin_dir}:{os.environ['PATH']}", **env)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "Building the CPU kernels" in first.stderr and "Building the CPU kernels" not in second.stderr
    assert first.stdout.split() == second.stdout.split()  # one build, untouched


def test_threads_never_exceed_the_cpus_this_process_may_use(caplog):
    """--threads past the affinity set is lowered to it (with a warning): OpenMP threads
    beyond the cores only contend."""
    import logging

    import torch

    cpus = platform.available_cpus()
    saved = torch.get_num_threads()
    try:
        with caplog.at_level(logging.WARNING, logger="lane.platform"):
            assert platform.set_threads(cpus + 3) == cpus == torch.get_num_threads()
        assert f"--threads {cpus + 3} exceeds the {cpus} CPUs" in caplog.text
        assert platform.set_threads(None) == cpus
        with pytest.raises(ValueError, match="--threads must be >= 1"):
            platform.set_threads(-1)
    finally:
        torch.set_num_threads(saved)


BIND_PROBE = """
import glob, json, sys, torch
from lane import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory_bytes=16 << 20, show_progress=False)
llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
with torch.inference_mode():  # run the pool, then read every thread's CPU set
    torch.ones(4096, 4096) @ torch.ones(4096, 64)
sets = []
for status in glob.glob("/proc/self/task/*/status"):
    line = next(l for l in open(status) if l.startswith("Cpus_allowed_list:"))
    sets.append(line.split()[1])
print(json.dumps(sets))
"""


@pytest.mark.skipif(platform.available_cpus() < 2, reason="binding needs two CPUs to show")
def test_openmp_threads_are_pinned_one_per_cpu(tiny_llama):
    """LANE_CPU_OMP_THREADS_BIND=auto pins OpenMP thread i to the i-th CPU (as an engine-core
    process does by default); nobind leaves every thread on every CPU; a CPU the process may not
    use is refused by name."""
    cpus = sorted(os.sched_getaffinity(0))
    r = run_capped(BIND_PROBE, None, tiny_llama, LANE_CPU_OMP_THREADS_BIND="auto")
    assert r.returncode == 0, r.stderr[-2000:]
    sets = json.loads(r.stdout.strip().splitlines()[-1])
    for c in cpus:  # one thread on each CPU alone
        assert str(c) in sets, (c, sets)
    assert f"Bound {len(cpus)} OpenMP threads to CPUs {cpus}" in r.stderr
    r = run_capped(BIND_PROBE, None, tiny_llama, LANE_CPU_OMP_THREADS_BIND="nobind")
    assert r.returncode == 0 and "Bound" not in r.stderr
    assert len(set(json.loads(r.stdout.strip().splitlines()[-1]))) == 1  # all threads: the whole set
    bad = max(cpus) + 100
    r = run_capped(BIND_PROBE, None, tiny_llama, LANE_CPU_OMP_THREADS_BIND=f"0,{bad}")
    assert r.returncode != 0 and f"[{bad}] are not" in r.stderr

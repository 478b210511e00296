"""`lane generate` as a user runs it: a real subprocess, real model."""
import os
import subprocess
import sys

import pytest

LANE = [sys.executable, "-m", "lane.entrypoints.cli"]
# the float32 path; the quantized one (Q4_1 x 8-bit activations) answers the chat question with
# "L'Étoile, la ...", as llama.cpp does on the same file
SMALL = ["--dtype", "float32", "--quantization", "none", "--kv-cache-memory-bytes", "256M", "--max-model-len", "512"]


def run(*args, timeout=600):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([*LANE, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_generate_streams_default_model():
    r = run("generate", "Once upon a time", "--max-tokens", "12", *SMALL)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Once upon a time, the city of Nova Haven")
    # the start-up line says what was loaded and how big the KV pool is
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in r.stderr and "KV cache" in r.stderr
    assert "float32" in r.stderr


def test_generate_chat():
    r = run("generate", "What is the capital of France?", "--chat", "--max-tokens", "24", "--quiet", *SMALL)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


@pytest.mark.parametrize("args, needle", [
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "1.5"], "--top-p"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--block-size", "x"], "--block-size"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--kv-cache-memory-bytes", "lots"], "--kv-cache-memory-bytes"),
    (["--model", "/no/such/model"], "does not exist"),
    (["--device", "cuda"], "--device cuda: lane runs on the CPU only for now"),
])
def test_bad_input_is_a_clear_error(args, needle):
    r = run("generate", "hi", "--quiet", *args)
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args, needle", [
    (["--port", "0"], "--port"),
    (["--data-parallel-size", "0"], "--data-parallel-size"),
    (["--model", "/no/such/model"], "does not exist"),
    (["--max-model-len", "100000"], "--max-model-len"),
    (["/no/such/dir", "--model", "/other"], "either as MODEL or as --model"),
    (["--enable-auto-tool-choice"], "--tool-call-parser"),
    (["--tool-call-parser", "nope"], "--tool-call-parser"),
    (["--chat-template", "/no/such.jinja"], "--chat-template"),
    (["--chat-template", "{% if %}"], "--chat-template"),
    (["--device", "cuda:0"], "--device cuda:0: lane runs on the CPU only for now"),
    (["--device", "nope"], "--device 'nope' is not a device"),
])
def test_serve_bad_flags_are_clear_errors(args, needle):
    r = run("serve", *args, timeout=120)
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_serve_engine_start_failure_is_reported():
    # a KV budget too small for one max-length request: the engine process fails, the
    # server says so and exits (no hang, no traceback from the frontend)
    r = run("serve", "--dtype", "float32", "--kv-cache-memory-bytes", "1M", "--port", "1", timeout=300)
    assert r.returncode == 1
    assert "engine core 0 failed to start" in r.stderr
    assert "raise --kv-cache-memory-bytes" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_machine_with_a_gpu_runs_on_its_cpu(monkeypatch):
    """Where torch sees CUDA, the default device is still the CPU (lane's CUDA path is not
    built): the model and its KV pools stay together."""
    import torch

    from lane import platform
    from lane.config import ModelConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert platform.default_device() == torch.device("cpu")
    assert ModelConfig().device_type == torch.device("cpu")
    assert ModelConfig(device="cpu").device_type == torch.device("cpu")
    with pytest.raises(ValueError, match="--device cuda: lane runs on the CPU only"):
        ModelConfig(device="cuda")


def test_build_kernels_is_the_install_step():
    """`lane build-kernels` (the README's install ends with it) leaves the build `lane serve` loads."""
    from lane import platform
    from lane.model_executor.layers import cpu_kernels

    r = run("build-kernels")
    assert r.returncode == 0, r.stderr
    assert f"CPU kernels for {platform.cpu_isa()} ready in {cpu_kernels.cache_root()}" in r.stdout
    assert cpu_kernels.build() and cpu_kernels.isa() == platform.cpu_isa()

"""`lane generate` as a user runs it: a real subprocess, real model."""
import os
import subprocess
import sys

import pytest

LANE = [sys.executable, "-m", "lane.entrypoints.cli"]
SMALL = ["--dtype", "float32", "--kv-cache-memory-bytes", "256M", "--max-model-len", "512"]


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
])
def test_bad_input_is_a_clear_error(args, needle):
    r = run("generate", "hi", "--quiet", *args)
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr

"""Which code each process loads (issue 13): the API server of `lane serve` tokenises,
detokenises and answers HTTP, and never imports the engine's model stack; the bench
client tokenises its prompts without lane.config or torch. Real processes, real HTTP
on loopback; each process reports its own sys.modules."""
import json
import os
import signal
import subprocess
import sys
import time

import httpx2 as httpx

from utils import RemoteServer

SERVER_ARGS = ["--kv-cache-memory-bytes", "64M", "--max-model-len", "1024"]

# `lane serve` as cli.main runs it, plus a SIGUSR1 handler that writes this process's
# modules to $LANE_MODULES_REPORT (a copy of sys.modules: other threads may import)
REPORTING_SERVE = r"""
import json, os, signal, sys

def report_modules(*_):
    path = os.environ["LANE_MODULES_REPORT"]
    with open(path + ".part", "w") as f:
        json.dump(sorted(sys.modules.copy()), f)
    os.replace(path + ".part", path)

signal.signal(signal.SIGUSR1, report_modules)
from lane.entrypoints.cli import main
sys.exit(main(sys.argv[1:]))
"""

ENGINE_SIDE_PACKAGES = ("lane.model_executor", "lane.worker", "lane.core.scheduler")


def engine_side(name: str) -> bool:
    """A module only an engine-core process needs (lane.engine.core itself, not core_client)."""
    return name == "lane.engine.core" or any(name == p or name.startswith(p + ".") for p in ENGINE_SIDE_PACKAGES)


def test_api_server_loads_no_engine_code(tmp_path):
    report = tmp_path / "modules.json"
    with RemoteServer(SERVER_ARGS, env={"LANE_MODULES_REPORT": str(report)},
                      launcher=[sys.executable, "-c", REPORTING_SERVE]) as server:
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] and r.json()["usage"]["completion_tokens"] > 0
        r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        engines = server.engine_pids()
        assert engines and server.proc.pid not in engines  # the model runs in its own process
        os.kill(server.proc.pid, signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while not report.exists():
            assert time.monotonic() < deadline, f"the API server wrote no module report:\n{server.read_log()}"
            time.sleep(0.1)
    modules = json.loads(report.read_text())
    assert [m for m in modules if engine_side(m)] == []
    # the report is the API server's own: it serves HTTP and built the tokenizer
    assert "lane.entrypoints.api_server" in modules and "tokenizers" in modules


# what `lane bench` does before it sends a request: its flags, the tokenizer, the prompts
BENCH_CLIENT = r"""
import argparse, json, sys
from lane.bench import benchmark

parser = argparse.ArgumentParser(prog="lane bench")
benchmark.add_cli_args(parser)
args = parser.parse_args(sys.argv[1:])
benchmark.check_args(args, parser)
tok = benchmark.load_tokenizer(args, "http://127.0.0.1:9", {})  # --tokenizer given: no server is asked
samples = benchmark.build_dataset(args, tok)
print(json.dumps({"prompt_lens": [s.prompt_len for s in samples], "modules": sorted(sys.modules)}))
"""


def run_python(code: str, *args: str) -> dict:
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_bench_client_loads_no_torch(smollm_gguf):
    out = run_python(BENCH_CLIENT, "--tokenizer", smollm_gguf, "--dataset-name", "random", "--num-prompts", "4",
                     "--random-input-len", "32", "--random-output-len", "4")
    assert len(out["prompt_lens"]) == 4 and all(n > 0 for n in out["prompt_lens"])
    modules = out["modules"]
    assert "torch" not in modules and "lane.config" not in modules
    assert [m for m in modules if engine_side(m)] == []
    assert "tokenizers" in modules  # the prompts were tokenised here


def test_package_exports_load_on_first_use():
    out = run_python("""
import json, sys
import lane
light = "torch" not in sys.modules
from lane import LLM, CompletionOutput, Logprob, ModelRegistry, RequestOutput, SamplingParams
print(json.dumps({"light": light, "names": [LLM.__name__, SamplingParams.__name__, RequestOutput.__name__],
                  "archs": ModelRegistry.get_supported_archs()}))
""")
    assert out["light"]
    assert out["names"] == ["LLM", "SamplingParams", "RequestOutput"]
    assert "LlamaForCausalLM" in out["archs"]

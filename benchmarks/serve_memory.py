"""Resident memory of `lane serve`'s processes: the API server (frontend) and each
engine core, from /proc/<pid>/status (VmRSS), once the server answers /health and
again after it has served one completion.

    PYTHONPATH=src python benchmarks/serve_memory.py [--runs 3] [-- extra `lane serve` flags]

The PYTHONPATH decides which checkout's lane is started (this script measures any).
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import httpx2 as httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cold_start import wait_healthy  # noqa: E402
from peers import free_port  # noqa: E402
from serving import stop  # noqa: E402

SERVE_ARGS = ["--kv-cache-memory-bytes", "256M", "--max-model-len", "2048"]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib / 1024


def complete(url: str) -> str:
    body = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def measure(python: str, serve_args: list[str], settle_s: float, timeout_s: float) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.NamedTemporaryFile("w+", prefix="lane-serve-mem-", suffix=".log") as log:
        proc = subprocess.Popen([python, "-m", "lane.entrypoints.cli", "serve", "--port", str(port), *serve_args],
                                stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "LANE_LOGGING_LEVEL": "INFO"})
        try:
            wait_healthy(proc, url + "/health", timeout_s)
            log.seek(0)
            m = re.search(r"engine core\(s\) \(pids ([0-9, ]+)\)", log.read())
            engines = [int(p) for p in m.group(1).split(",")] if m else []
            time.sleep(settle_s)
            out = {"api_server_started": rss_mib(proc.pid),
                   "engine_cores_started": [rss_mib(p) for p in engines]}
            text = complete(url)
            time.sleep(settle_s)
            out.update(api_server_after_request=rss_mib(proc.pid),
                       engine_cores_after_request=[rss_mib(p) for p in engines], text=text)
            return out
        finally:
            stop(proc)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--settle-s", type=float, default=1.0, help="wait before each reading")
    p.add_argument("--timeout-s", type=float, default=240.0)
    p.add_argument("serve_args", nargs="*", help=f"`lane serve` flags (default: {' '.join(SERVE_ARGS)})")
    args = p.parse_args()
    runs = [measure(args.python, args.serve_args or SERVE_ARGS, args.settle_s, args.timeout_s)
            for _ in range(args.runs)]
    for i, r in enumerate(runs):
        print(f"run {i}: API server {r['api_server_started']:.1f} -> {r['api_server_after_request']:.1f} MiB; "
              f"engine cores {[round(x, 1) for x in r['engine_cores_started']]} -> "
              f"{[round(x, 1) for x in r['engine_cores_after_request']]} MiB; text {r['text']!r}")
    print("median VmRSS (MiB):")
    for key in ("api_server_started", "api_server_after_request"):
        print(f"  {key:28s} {statistics.median(r[key] for r in runs):8.1f}")
    for key in ("engine_cores_started", "engine_cores_after_request"):
        print(f"  {key:28s} {statistics.median(sum(r[key]) for r in runs):8.1f} (all engine cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

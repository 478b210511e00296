"""`lane bench` against `vllm bench serve`: two benchmark clients, one lane server, the
same workload, one run. The two tools must agree within noise on TTFT, TPOT and
throughput (they time a stream the same way).

Starts `lane serve` (the CPU's fastest dtype, the embedded SmolLM2, prefix caching off), runs
`lane bench` and then `vllm bench serve` (from the vLLM venv, benchmarks/setup_vllm_cpu.sh)
with the same flags: random dataset, 64 prompts, 256 in / 128 out, ignore_eos,
concurrency 8. Prints both and the ratios vLLM / lane.

    python benchmarks/bench_client.py [--num-prompts 64] [--max-concurrency 8]

The last line is a JSON object of the headline figures. About 3 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers import LAUNCHER, free_port, smollm_hf_dir, vllm_python  # noqa: E402
from serving import stop, wait_ready  # noqa: E402

from lane.bench.report import compare  # noqa: E402


def run_client(argv: list[str], env: dict | None = None) -> float:
    """Run a benchmark client at the lowest CPU priority (on 2 cores a client's own work
    would otherwise slow the server it measures); returns the CPU seconds it used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(["nice", "-n", "19", *argv], check=True, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    args = ap.parse_args()
    py = vllm_python()
    if py is None:
        sys.exit("vLLM's CPU build is not set up: bash benchmarks/setup_vllm_cpu.sh")
    out_dir = tempfile.mkdtemp(prefix="bench-client-")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = os.path.join(out_dir, "lane-serve.log")
    server = subprocess.Popen([sys.executable, "-m", "lane.entrypoints.cli", "serve", "--port", str(port),
                               "--no-enable-prefix-caching", "--max-model-len", "4096"],
                              stdout=open(log, "w"), stderr=subprocess.STDOUT,
                              env={**os.environ, "LANE_LOGGING_LEVEL": "WARNING"})
    common = ["--base-url", url, "--dataset-name", "random", "--num-prompts", str(args.num_prompts),
              "--max-concurrency", str(args.max_concurrency), "--random-input-len", str(args.input_len),
              "--random-output-len", str(args.output_len), "--ignore-eos", "--seed", "0", "--temperature", "0",
              "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
    try:
        wait_ready(url, server, "lane", 300, log)
        model_dir = smollm_hf_dir()  # vllm bench tokenizes with the same tokenizer, from the HF copy
        lane_dir = os.path.join(out_dir, "lane-bench")
        print("== lane bench ==", flush=True)
        lane_cpu = run_client([sys.executable, "-m", "lane.entrypoints.cli", "bench", *common,
                               "--num-warmups", "1", "--result-dir", lane_dir])
        print("== vllm bench serve ==", flush=True)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
        vllm_cpu = run_client([py, LAUNCHER, "bench", "serve", *common, "--backend", "openai",
                               "--endpoint", "/v1/completions", "--tokenizer", model_dir, "--num-warmups", "1",
                               "--save-result", "--result-dir", out_dir, "--result-filename", "vllm-bench.json"],
                              env=env)
    finally:
        stop(server)
    a, b = os.path.join(lane_dir, "summary.json"), os.path.join(out_dir, "vllm-bench.json")
    print("\nsame server, same workload: lane bench (A) vs vllm bench serve (B)")
    print(compare(a, b))
    print(f"client CPU time (start-up included): lane bench {lane_cpu:.1f} s, vllm bench serve {vllm_cpu:.1f} s")
    with open(a) as f:
        la = json.load(f)
    with open(b) as f:
        vb = json.load(f)
    head = {"lane_bench_cpu_s": round(lane_cpu, 1), "vllm_bench_cpu_s": round(vllm_cpu, 1)}
    for key in ("output_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
                "mean_itl_ms", "mean_e2el_ms"):
        head[f"lane_bench_{key}"] = round(la[key], 2)
        head[f"vllm_bench_{key}"] = round(vb[key], 2)
        head[f"ratio_{key}"] = round(vb[key] / la[key], 3) if la[key] else None
    print(json.dumps(head))


if __name__ == "__main__":
    main()

"""PD disaggregation on this machine (issue 32): one `lane serve` on every core against a prefill
and a decode `lane serve` (one core each, the TCP connector) behind `lane proxy`, same client.

Workloads (`lane bench`, greedy, ignore_eos): random 1024-token prompts with 128 output tokens, and
the prefix dataset (groups of prompts sharing a 512-token prefix, 256-token suffixes). Printed per
setup: output tok/s, mean TTFT and TPOT; for PD, the KV each request moved (bytes, ms, from the
decode instance's lane:kv_transfer_* metrics) and its GB/s against this machine's loopback limit
measured in the same run (one ZeroMQ TCP socket pair on 127.0.0.1 moving 64 MiB messages).

    python benchmarks/pd.py [--num-prompts 16] [--concurrency 4] [--model PATH]

The last line is a JSON object of the headline figures. About 10 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx2 as httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers import free_port  # noqa: E402
from serving import say, stop, wait_healthy  # noqa: E402

LANE = [sys.executable, "-m", "lane.entrypoints.cli"]
SECRET = os.environ.get("LANE_RPC_SECRET") or "pd-benchmark-secret-" + os.urandom(8).hex()


def loopback_gb_s(mib: int = 64, rounds: int = 8) -> float:
    """ZeroMQ over TCP on 127.0.0.1: what one socket pair moves per second (the pull's transport)."""
    import zmq

    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    port = a.bind_to_random_port("tcp://127.0.0.1")
    b.connect(f"tcp://127.0.0.1:{port}")
    msg = os.urandom(mib << 20)
    a.send(msg)
    b.recv()  # warm
    t0 = time.perf_counter()
    for _ in range(rounds):
        a.send(msg, copy=False)
        b.recv(copy=False)
    dt = time.perf_counter() - t0
    a.close(0)
    b.close(0)
    ctx.term()
    return rounds * len(msg) / dt / 1e9


def serve(args, cpus: str, extra: list[str], log: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = ["taskset", "-c", cpus, *LANE, "serve", "--port", str(port), "--served-model-name", "m",
            "--max-model-len", "4096", *(["--model", args.model] if args.model else []), *extra]
    proc = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "LANE_RPC_SECRET": SECRET, "LANE_LOGGING_LEVEL": "WARNING"})
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, 600, log)
    return proc, url


def bench(url: str, dataset: str, args, out_dir: str) -> dict:
    flags = (["--random-input-len", "1024", "--random-output-len", "128"] if dataset == "random" else
             ["--prefix-repetition-prefix-len", "512", "--prefix-repetition-suffix-len", "256",
              "--prefix-repetition-num-prefixes", "4", "--prefix-repetition-output-len", "128"])
    rdir = os.path.join(out_dir, f"{dataset}-{time.monotonic_ns()}")
    p = subprocess.run([*LANE, "bench", "--base-url", url, "--model", "m", "--dataset-name", dataset, *flags,
                        "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
                        "--ignore-eos", "--temperature", "0", "--seed", "0", "--disable-tqdm", "--result-dir", rdir],
                       capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"lane bench failed:\n{p.stderr[-2000:]}")
    with open(os.path.join(rdir, "summary.json")) as f:
        return json.load(f)


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit("benchmarks/pd.py needs 2 CPUs (one per instance)")
    tmp = tempfile.mkdtemp(prefix="pd-")
    say(f"logs and results in {tmp}")
    link = loopback_gb_s()
    say(f"loopback (ZeroMQ TCP, 64 MiB messages): {link:.2f} GB/s")
    results: dict[str, dict] = {}
    proc, url = serve(args, ",".join(map(str, cpus)), [], os.path.join(tmp, "one.log"))
    try:
        for ds in ("random", "prefix"):
            results[f"one:{ds}"] = bench(url, ds, args, tmp)
    finally:
        stop(proc)
    kv_port = free_port()
    p, p_url = serve(args, str(cpus[0]), ["--threads", "1", "--kv-transfer-config", json.dumps(
        {"kv_connector": "TcpConnector", "kv_role": "kv_producer", "kv_port": kv_port})], os.path.join(tmp, "p.log"))
    d, d_url = serve(args, str(cpus[1]), ["--threads", "1", "--kv-transfer-config", json.dumps(
        {"kv_connector": "TcpConnector", "kv_role": "kv_consumer", "kv_port": free_port()})],
        os.path.join(tmp, "d.log"))
    port = free_port()
    proxy = subprocess.Popen([*LANE, "proxy", "--port", str(port), "--prefiller-ports", p_url.rsplit(":", 1)[1],
                              "--decoder-ports", d_url.rsplit(":", 1)[1]], stdout=open(os.path.join(tmp, "proxy.log"), "w"),
                             stderr=subprocess.STDOUT)
    proxy_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proxy_url, proxy, 120, os.path.join(tmp, "proxy.log"))
        for ds in ("random", "prefix"):
            b0, s0, n0 = (metric(d_url, "lane:kv_transfer_bytes_total"), metric(d_url, "lane:kv_transfer_seconds_sum"),
                          metric(d_url, "lane:kv_transfer_seconds_count"))
            r = bench(proxy_url, ds, args, tmp)
            b1, s1 = metric(d_url, "lane:kv_transfer_bytes_total"), metric(d_url, "lane:kv_transfer_seconds_sum")
            n = max(r.get("completed") or 1, 1)
            r["kv_bytes_per_request"] = (b1 - b0) / n
            r["kv_ms_per_request"] = (s1 - s0) / n * 1e3
            r["kv_gb_s"] = (b1 - b0) / (s1 - s0) / 1e9 if s1 > s0 else float("nan")
            r["decode_prompt_tokens_computed"] = metric(d_url, "lane:prompt_tokens_computed_total")
            results[f"pd:{ds}"] = r
    finally:
        stop(proxy)
        stop(p)
        stop(d)
    print(f"\n{args.num_prompts} requests at concurrency {args.concurrency}; one instance on CPUs {cpus}, against "
          f"prefill on CPU {cpus[0]} + decode on CPU {cpus[1]} behind lane proxy (TCP connector)")
    print(f"{'setup':<14} {'out tok/s':>9} {'TTFT ms':>9} {'TPOT ms':>8} {'KV/request':>12} {'KV ms':>7} {'KV GB/s':>8}")
    head: dict = {"loopback_gb_s": round(link, 2)}
    for key, r in results.items():
        kv = (f"{r['kv_bytes_per_request'] / 2**20:>10.2f}Mi {r['kv_ms_per_request']:>7.1f} {r['kv_gb_s']:>8.3f}"
              if key.startswith("pd") else "")
        print(f"{key:<14} {r['output_throughput']:>9.1f} {r['mean_ttft_ms']:>9.1f} {r['mean_tpot_ms']:>8.2f} {kv}")
        k = key.replace(":", "_")
        head[f"{k}_tok_s"] = round(r["output_throughput"], 1)
        head[f"{k}_ttft_ms"] = round(r["mean_ttft_ms"], 1)
        head[f"{k}_tpot_ms"] = round(r["mean_tpot_ms"], 2)
        if key.startswith("pd"):
            head[f"{k}_kv_mib_per_req"] = round(r["kv_bytes_per_request"] / 2**20, 3)
            head[f"{k}_kv_ms_per_req"] = round(r["kv_ms_per_request"], 2)
            head[f"{k}_kv_gb_s"] = round(r["kv_gb_s"], 3)
            head[f"{k}_kv_share_of_loopback"] = round(r["kv_gb_s"] / link, 3)
    for ds in ("random", "prefix"):
        one, pd = results[f"one:{ds}"], results[f"pd:{ds}"]
        print(f"  {ds}: PD / one instance: tok/s {pd['output_throughput'] / one['output_throughput']:.2f}x, "
              f"TTFT {pd['mean_ttft_ms'] / one['mean_ttft_ms']:.2f}x, TPOT {pd['mean_tpot_ms'] / one['mean_tpot_ms']:.2f}x; "
              f"the pull at {pd['kv_gb_s']:.3f} GB/s is {pd['kv_gb_s'] / link:.1%} of loopback")
    print(json.dumps(head))


if __name__ == "__main__":
    main()

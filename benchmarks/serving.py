"""Online serving: `lane serve` against vLLM's CPU build, same streaming workload, one run.

Both serve the same weights (the packaged SmolLM2-135M-Instruct, converted once to an HF
directory in bfloat16 by peers.smollm_hf_dir), in one dtype (`--dtype auto`: the CPU's fastest,
bfloat16 with AVX512-BF16, else float32), prefix caching off. The
client streams /v1/completions with random token-id prompts (no shared prefixes),
ignore_eos, at each --concurrency level: first against lane, then against vLLM (started
from its own venv, benchmarks/setup_vllm_cpu.sh). Printed for each: output tokens/s and
TTFT / TPOT / ITL percentiles, then the ratios lane : vLLM.

    python benchmarks/serving.py [--concurrency 1 8 32] [--input-len 256] [--output-len 128] [--lane-gguf]

--lane-gguf also serves lane on the packaged GGUF as it runs by default (Q4_1 blocks kept,
--quantization auto) against the same vLLM run: vLLM's CPU build at its fastest dtype against
lane at its fastest way of serving the same model.

The last line is a JSON object of the headline figures. About 6 minutes on 2 cores
(vLLM's start-up alone takes 80-95 s).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx2 as httpx
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_throughput import DTYPES, check_quiet, concrete_dtype  # noqa: E402
from peers import free_port, smollm_gguf_path, smollm_hf_dir, vllm_python, vllm_serve_command  # noqa: E402

SERVED_NAME = "smollm2"


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def stream_one(client: httpx.AsyncClient, url: str, prompt: list[int], output_len: int) -> RequestResult:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    res = RequestResult(ok=False)
    last = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itls.append(now - last)
                    last = now
        res.latency = time.perf_counter() - t0
        res.ok = res.output_tokens > 0
    except httpx.HTTPError as e:
        res.error = repr(e)
    return res


async def run_level(url: str, prompts: list[list[int]], output_len: int, concurrency: int, label: str) -> dict:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        # warm-up: one request per level, not measured
        await stream_one(client, url, prompts[0][:32], 4)
        bar = tqdm(total=len(prompts), desc=f"{label} c={concurrency}", unit="req", leave=False)

        async def guarded(p):
            async with sem:
                r = await stream_one(client, url, p, output_len)
                bar.update(1)
                return r

        t0 = time.perf_counter()
        results = await asyncio.gather(*(guarded(p) for p in prompts))
        duration = time.perf_counter() - t0
        bar.close()
    return summarize(results, duration)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft * 1000 for r in ok]
    tpot = [r.tpot * 1000 for r in ok if r.tpot is not None]
    itl = [x * 1000 for r in ok for x in r.itls]
    out_tokens = sum(r.output_tokens for r in ok)
    summary = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
               "output_tok_s": out_tokens / duration}
    for name, vals in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        summary[f"{name}_mean_ms"] = statistics.fmean(vals) if vals else float("nan")
        for q in (50, 99):
            summary[f"{name}_p{q}_ms"] = pct(vals, q)
    errors = [r.error for r in results if not r.ok]
    if errors:
        summary["first_error"] = errors[0]
    return summary


def wait_ready(url: str, proc: subprocess.Popen, owned_by: str, timeout_s: float, log: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; log: {log}")
        try:
            models = httpx.get(url + "/v1/models", timeout=2).json()["data"]
            if models and models[0].get("owned_by") == owned_by:
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(1)
    raise TimeoutError(f"server not ready after {timeout_s} s; log: {log}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def bench_server(name: str, argv: list[str], env: dict, owned_by: str, port: int, levels, workloads,
                 output_len: int) -> dict[int, dict]:
    log = tempfile.NamedTemporaryFile("w", prefix=f"bench-{name}-", suffix=".log", delete=False)
    print(f"starting {name} (log: {log.name}) ...", file=sys.stderr)
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, owned_by, 300, log.name)
        print(f"{name} ready in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        check_quiet()
        return {c: asyncio.run(run_level(url, workloads[c], output_len, c, name)) for c in levels}
    finally:
        stop(proc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests-per-level", type=int, nargs="+", default=None,
                    help="requests at each level (default: 8, 32, 64 for 1, 8, 32; else 2x concurrency)")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-vllm", action="store_true", help="only lane (no vLLM venv needed)")
    ap.add_argument("--dtype", default="auto", choices=DTYPES, help="auto: the CPU's fastest")
    ap.add_argument("--lane-gguf", action="store_true",
                    help="also serve lane on the packaged GGUF as lane runs it by default (--quantization "
                         "auto: Q4_1 blocks), against the same vLLM run")
    args = ap.parse_args()
    dtype = concrete_dtype(args.dtype)

    default_n = {1: 8, 8: 32, 32: 64}
    counts = args.requests_per_level or [default_n.get(c, 2 * c) for c in args.concurrency]
    if len(counts) != len(args.concurrency):
        ap.error("--requests-per-level needs one count per --concurrency level")
    rng = random.Random(args.seed)
    # random token ids, no shared prefixes: the same prompts for both servers
    workloads = {c: [[rng.randrange(1000, 40000) for _ in range(args.input_len)] for _ in range(n)]
                 for c, n in zip(args.concurrency, counts)}
    model_dir = smollm_hf_dir()
    results: dict[str, dict[int, dict]] = {}

    port = free_port()
    lane_argv = [sys.executable, "-m", "lane.entrypoints.cli", "serve", model_dir, "--port", str(port),
                 "--served-model-name", SERVED_NAME, "--dtype", dtype, "--no-enable-prefix-caching",
                 "--max-model-len", "4096"]
    results["lane"] = bench_server("lane", lane_argv, {**os.environ, "LANE_LOGGING_LEVEL": "WARNING"},
                                   "lane", port, args.concurrency, workloads, args.output_len)
    if args.lane_gguf:
        port = free_port()
        argv = [sys.executable, "-m", "lane.entrypoints.cli", "serve", smollm_gguf_path(), "--port", str(port),
                "--served-model-name", SERVED_NAME, "--dtype", dtype, "--quantization", "auto",
                "--no-enable-prefix-caching", "--max-model-len", "4096"]
        results["lane-q"] = bench_server("lane-q", argv, {**os.environ, "LANE_LOGGING_LEVEL": "WARNING"},
                                         "lane", port, args.concurrency, workloads, args.output_len)
    py = None if args.skip_vllm else vllm_python()
    if py is None and not args.skip_vllm:
        print("vLLM's CPU build is not set up (bash benchmarks/setup_vllm_cpu.sh); lane only", file=sys.stderr)
    if py is not None:
        port = free_port()
        argv, env = vllm_serve_command(py, model_dir, port, SERVED_NAME, extra=["--max-model-len", "4096"],
                                       dtype=dtype)
        results["vllm"] = bench_server("vllm", argv, env, "vllm", port, args.concurrency, workloads,
                                       args.output_len)

    print(f"\nstreaming /v1/completions, {args.input_len} in / {args.output_len} out, {dtype}, "
          f"prefix caching off")
    head = (f"{'server':<6} {'conc':>4} {'reqs':>5} {'out tok/s':>9} {'TTFT mean':>9} {'P50':>7} {'P99':>7} "
            f"{'TPOT mean':>9} {'P50':>6} {'P99':>6} {'ITL P99':>7}  (ms)")
    print(head)
    for name, by_level in results.items():
        for c, s in by_level.items():
            print(f"{name:<6} {c:>4} {s['completed']:>5} {s['output_tok_s']:>9.1f} {s['ttft_mean_ms']:>9.1f} "
                  f"{s['ttft_p50_ms']:>7.1f} {s['ttft_p99_ms']:>7.1f} {s['tpot_mean_ms']:>9.1f} "
                  f"{s['tpot_p50_ms']:>6.1f} {s['tpot_p99_ms']:>6.1f} {s['itl_p99_ms']:>7.1f}"
                  + (f"  failed {s['failed']}: {s.get('first_error')}" if s["failed"] else ""))
    headline: dict[str, float | int] = {}
    for c in args.concurrency:
        lane_s = results["lane"][c]
        if "lane-q" in results:
            q = results["lane-q"][c]
            headline[f"lane_gguf_tok_s_c{c}"] = round(q["output_tok_s"], 1)
            headline[f"lane_gguf_tpot_ms_c{c}"] = round(q["tpot_mean_ms"], 2)
            if "vllm" in results:
                headline[f"ratio_gguf_tok_s_c{c}"] = round(q["output_tok_s"] / results["vllm"][c]["output_tok_s"], 2)
        headline[f"lane_tok_s_c{c}"] = round(lane_s["output_tok_s"], 1)
        headline[f"lane_ttft_ms_c{c}"] = round(lane_s["ttft_mean_ms"], 1)
        headline[f"lane_tpot_ms_c{c}"] = round(lane_s["tpot_mean_ms"], 2)
        if "vllm" in results:
            v = results["vllm"][c]
            headline[f"vllm_tok_s_c{c}"] = round(v["output_tok_s"], 1)
            headline[f"vllm_ttft_ms_c{c}"] = round(v["ttft_mean_ms"], 1)
            headline[f"vllm_tpot_ms_c{c}"] = round(v["tpot_mean_ms"], 2)
            headline[f"ratio_tok_s_c{c}"] = round(lane_s["output_tok_s"] / v["output_tok_s"], 2)
            headline[f"ratio_ttft_c{c}"] = round(v["ttft_mean_ms"] / lane_s["ttft_mean_ms"], 2)
            headline[f"ratio_tpot_c{c}"] = round(v["tpot_mean_ms"] / lane_s["tpot_mean_ms"], 2)
    if "vllm" in results:
        print("\nratios (>1: lane better): output tok/s lane/vLLM, TTFT and TPOT vLLM/lane")
        for c in args.concurrency:
            print(f"  c={c:<3} tok/s {headline[f'ratio_tok_s_c{c}']:.2f}  TTFT {headline[f'ratio_ttft_c{c}']:.2f}"
                  f"  TPOT {headline[f'ratio_tpot_c{c}']:.2f}"
                  + (f"   lane on the GGUF (Q4_1 blocks) / vLLM tok/s {headline[f'ratio_gguf_tok_s_c{c}']:.2f}"
                     if "lane-q" in results else ""))
    print(json.dumps(headline))


if __name__ == "__main__":
    main()

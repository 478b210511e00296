"""The serving path's cost at concurrency 1 (issue 30 item 1): `lane serve` against the same
engine stepped in-process, same model, same kind of prompts, alternated in one run.

In-process: `lane.LLM()` on the default model (the packaged SmolLM2 Q4_1, `--quantization auto`),
its EngineCore stepped directly: the step that prefills a 256-token prompt (and samples its
first token) and the 127 decode steps after it, each timed alone; the frontend's output
processing (detokenisation) timed apart.

Served: `lane serve` with its defaults, one streaming client (/v1/completions, token-id prompts,
128 output tokens, ignore_eos, greedy) sending one request after another: TTFT and TPOT as
`vllm bench serve` times them, TTFT split with the server's own `return_timing` (HTTP + input
processing until the request is queued, the engine's queue and prefill, the way back), and each
process's CPU time per output token and the time its threads waited for a CPU while runnable
(from /proc/<pid>/task/*/schedstat): API server, engine core (main thread, OpenMP workers), client.

    python benchmarks/serving_overhead.py [--rounds 2] [--requests 8] [--profile DIR] [-- SERVE ARGS]

--profile DIR also records both server processes with py-spy during one extra served phase
(`pip install py-spy`) and prints the functions where each spends its time (raw stacks and SVGs in
DIR). Arguments after `--` go to `lane serve`.

Targets (issue 30): TPOT <= 1.15x the in-process decode step, TTFT <= the in-process prefill + 10 ms.
The last line is a JSON object of the figures (medians over the rounds).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import httpx2 as httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers import free_port  # noqa: E402
from serving import stop, wait_ready  # noqa: E402

SERVED = "smollm2"

INPROC = r"""
import json, random, statistics, sys, time
from lane import LLM, SamplingParams
cfg = json.loads(sys.argv[1])
llm = LLM(show_progress=False)
eng, op = llm.engine, llm.output_processor
rng = random.Random(cfg["seed"])
prompt = lambda: [rng.randrange(1000, 40000) for _ in range(cfg["input_len"])]
def run(n):
    llm._add_processed(None, prompt(), SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), stream=True)
    steps, ops = [], []
    while op.has_unfinished():
        t0 = time.perf_counter(); outs = eng.step(); t1 = time.perf_counter()
        op.process_outputs(outs); t2 = time.perf_counter()
        steps.append(t1 - t0); ops.append(t2 - t1)
    return steps, ops
for _ in range(2):
    run(8)  # warm-up: the 256-token shapes, first-use costs
prefill, decode, opt = [], [], []
for _ in range(cfg["requests"]):
    s, o = run(cfg["output_len"])
    prefill.append(s[0]); decode += s[1:]; opt += o
print(json.dumps({"prefill_ms": statistics.median(prefill) * 1e3, "step_ms": statistics.median(decode) * 1e3,
                  "step_mean_ms": statistics.fmean(decode) * 1e3,
                  "output_processing_us": statistics.median(opt) * 1e6}))
"""


def thread_times(pid: int) -> dict[int, tuple[str, int, int]]:
    """tid -> (name, ns on a CPU, ns runnable but waiting for one)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                run, wait, _ = f.read().split()
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
        except (OSError, ValueError):
            continue
        out[int(tid)] = (name, int(run), int(wait))
    return out


def proc_times(pid: int) -> tuple[float, float, int, int]:
    """(user s, system s, voluntary, involuntary context switches) of a whole process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    tick = os.sysconf("SC_CLK_TCK")
    vol = invol = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        vol += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches"):
                        invol += int(line.split()[1])
        except OSError:
            pass
    return int(fields[11]) / tick, int(fields[12]) / tick, vol, invol


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def engine_pid(api_pid: int) -> int:
    """The engine core: the API server's child that runs the most threads (the other is
    multiprocessing's resource tracker)."""
    kids = children(api_pid)
    return max(kids, key=lambda p: len(os.listdir(f"/proc/{p}/task")))


def cpu_delta(pid: int, before: dict, after: dict) -> dict[str, float]:
    """Seconds on a CPU and waiting for one while runnable: the main thread, the others (an
    engine's OpenMP workers), all."""
    rows = []
    for tid, (name, run, wait) in after.items():
        r0, w0 = before.get(tid, (name, 0, 0))[1:]
        rows.append((tid, name, (run - r0) / 1e9, (wait - w0) / 1e9))
    main = pid
    out = {"main_run_s": 0.0, "main_wait_s": 0.0, "other_run_s": 0.0, "other_wait_s": 0.0}
    for tid, _, run, wait in rows:
        k = "main" if tid == main else "other"
        out[f"{k}_run_s"] += run
        out[f"{k}_wait_s"] += wait
    out["run_s"] = out["main_run_s"] + out["other_run_s"]
    out["wait_s"] = out["main_wait_s"] + out["other_wait_s"]
    return out


async def stream_one(client: httpx.AsyncClient, url: str, prompt: list[int], n: int) -> dict:
    body = {"model": SERVED, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_timing": True}
    t0 = time.perf_counter()
    first = last = None
    chunks, timing = 0, None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "timing" in chunk:
                timing = chunk["timing"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                now = time.perf_counter()
                first = first or now
                last = now
                chunks += 1
    end = time.perf_counter()
    return {"ttft_ms": (first - t0) * 1e3, "tpot_ms": (end - first) / (n - 1) * 1e3,
            "itl_ms": (last - first) / max(chunks - 1, 1) * 1e3, "chunks": chunks, "timing": timing}


async def client_run(url: str, prompts: list[list[int]], output_len: int, pids: list[int]) -> tuple[list, dict]:
    async with httpx.AsyncClient(timeout=600) as client:
        for p in prompts[:2]:  # warm-up
            await stream_one(client, url, p, 8)
        window = [time.monotonic()]
        before = {pid: thread_times(pid) for pid in pids}
        t_before = {pid: proc_times(pid) for pid in pids}
        c0 = time.process_time()
        res = [await stream_one(client, url, p, output_len) for p in prompts[2:]]
        cpu = {pid: cpu_delta(pid, before[pid], thread_times(pid)) for pid in pids}
        for pid in pids:
            t1 = proc_times(pid)
            cpu[pid].update(zip(("user_s", "sys_s", "vol_cs", "invol_cs"),
                                (b - a for a, b in zip(t_before[pid], t1))))
        cpu["client"] = {"run_s": time.process_time() - c0}
        cpu["window"] = window + [time.monotonic()]
    return res, cpu


def engine_steps(path: str, window: list[float]) -> dict:
    """From the engine's step log (LANE_STEP_LOG) within the measured window: the median decode
    step and prefill step (schedule + model + update, ms), and the median gap between two decode
    steps outside them (the loop's own work: outputs encoded and sent, inputs polled; us)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [r for r in rows if window[0] <= r["t"] <= window[1]]
    dur = lambda r: r["sched_ms"] + r["exec_ms"] + r["update_ms"]  # noqa: E731
    decode = [r for r in rows if r["prefill_tokens"] == 0]
    prefill = [r for r in rows if r["prefill_tokens"] > 0]
    gaps = [(b["t"] - a["t"]) * 1e3 - dur(a) for a, b in zip(rows, rows[1:])
            if a["prefill_tokens"] == 0 and b["prefill_tokens"] == 0]
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    return {"srv_step_ms": med([dur(r) for r in decode]), "srv_prefill_step_ms": med([dur(r) for r in prefill]),
            "srv_loop_gap_us": med(gaps) * 1e3,
            "srv_send_us": med([r["prev_send_us"] for r in decode if "prev_send_us" in r])}


def start_server(serve_args: list[str], log_path: str, step_log: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    argv = [sys.executable, "-m", "lane.entrypoints.cli", "serve", "--port", str(port),
            "--served-model-name", SERVED, *serve_args]
    proc = subprocess.Popen(argv, stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "LANE_LOGGING_LEVEL": "WARNING", "LANE_STEP_LOG": step_log})
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc, "lane", 600, log_path)
    return proc, url


def served(args, seed: int, log_path: str, profile_dir: str | None = None) -> dict:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.input_len)] for _ in range(args.requests + 2)]
    step_log = log_path + ".steps.jsonl"
    proc, url = start_server(args.serve_args, log_path, step_log)
    spies = []
    try:
        api, eng = proc.pid, engine_pid(proc.pid)
        if profile_dir:
            for name, pid in (("api_server", api), ("engine_core", eng)):
                base = os.path.join(profile_dir, name)
                for fmt, ext in (("raw", "txt"), ("flamegraph", "svg")):
                    spies.append(subprocess.Popen(
                        ["py-spy", "record", "--pid", str(pid), "--rate", "250", "--idle", "--threads",
                         "--format", fmt, "-o", f"{base}.{ext}", "--nonblocking"] if fmt == "raw" else
                        ["py-spy", "record", "--pid", str(pid), "--rate", "100", "--format", fmt,
                         "-o", f"{base}.{ext}", "--nonblocking"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            time.sleep(1.0)
        res, cpu = asyncio.run(client_run(url, prompts, args.output_len, [api, eng]))
    finally:
        for s in spies:
            s.send_signal(2)  # SIGINT: py-spy writes its file
        for s in spies:
            s.wait(30)
        stop(proc)
    tokens = args.requests * args.output_len
    t = [r["timing"] or {} for r in res]
    out = {"ttft_ms": statistics.median(r["ttft_ms"] for r in res),
           "tpot_ms": statistics.median(r["tpot_ms"] for r in res),
           "ttft_mean_ms": statistics.fmean(r["ttft_ms"] for r in res),
           "tpot_mean_ms": statistics.fmean(r["tpot_ms"] for r in res),
           # the server's view of the first token: queued after arrival, prefill = first token received
           # by the frontend - scheduled
           "srv_queue_ms": statistics.median(x.get("queue_ms", 0.0) for x in t),
           "srv_prefill_ms": statistics.median(x.get("prefill_ms", 0.0) for x in t),
           "srv_ttft_ms": statistics.median(x.get("ttft_ms", 0.0) for x in t),
           "srv_itl_ms": statistics.median(x.get("mean_itl_ms", 0.0) for x in t)}
    for name, pid in (("api", api), ("engine", eng)):
        c = cpu[pid]
        out[f"{name}_cpu_us_per_tok"] = c["run_s"] / tokens * 1e6
        out[f"{name}_main_cpu_us_per_tok"] = c["main_run_s"] / tokens * 1e6
        out[f"{name}_wait_us_per_tok"] = c["wait_s"] / tokens * 1e6
        out[f"{name}_sys_share"] = c["sys_s"] / max(c["user_s"] + c["sys_s"], 1e-9)
        out[f"{name}_cs_per_tok"] = (c["vol_cs"] + c["invol_cs"]) / tokens
        out[f"{name}_invol_cs_per_tok"] = c["invol_cs"] / tokens
    out["client_cpu_us_per_tok"] = cpu["client"]["run_s"] / tokens * 1e6
    if os.path.exists(step_log):  # an engine that does not write one (an older lane) leaves it out
        out.update(engine_steps(step_log, cpu["window"]))
    return out


def in_process(args, seed: int) -> dict:
    cfg = {"seed": seed, "input_len": args.input_len, "output_len": args.output_len, "requests": args.requests}
    p = subprocess.run([sys.executable, "-c", INPROC, json.dumps(cfg)], capture_output=True, text=True,
                       env={**os.environ, "LANE_LOGGING_LEVEL": "WARNING"})
    if p.returncode:
        raise RuntimeError(f"in-process run failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def summarize_profile(path: str, top: int = 14) -> str:
    """The functions a process spends its samples in (py-spy raw stacks), inclusive, per thread."""
    per_thread: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if not stack:
                continue
            frames = stack.split(";")
            thread, frames = frames[0], frames[1:]
            n = int(count)
            totals[thread] += n
            seen = set()
            for fr in frames:
                name = fr.split(" (")[0] + " (" + os.path.basename(fr.split(" (")[-1].split(":")[0]) + ")" \
                    if " (" in fr else fr
                if name not in seen:
                    per_thread[thread][name] += n
                    seen.add(name)
    lines = []
    for thread, total in totals.most_common(4):
        lines.append(f"  {thread}: {total} samples")
        for name, n in per_thread[thread].most_common(top):
            lines.append(f"    {100 * n / total:5.1f}%  {name}")
    return "\n".join(lines)


def main() -> None:
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8, help="measured requests per phase")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--profile", metavar="DIR", help="also profile one served phase with py-spy")
    ap.add_argument("--skip-in-process", action="store_true")
    args = ap.parse_args(argv)
    args.serve_args = serve_args
    tmp = tempfile.mkdtemp(prefix="serving-overhead-")
    inproc, serve = [], []
    for r in range(args.rounds):
        if not args.skip_in_process:
            inproc.append(in_process(args, 100 + r))
            print(f"round {r}: in-process " + ", ".join(f"{k} {v:.2f}" for k, v in inproc[-1].items()),
                  file=sys.stderr, flush=True)
        serve.append(served(args, 200 + r, os.path.join(tmp, f"serve-{r}.log")))
        print(f"round {r}: served " + ", ".join(f"{k} {v:.2f}" for k, v in serve[-1].items()),
              file=sys.stderr, flush=True)
    if args.profile:
        if shutil.which("py-spy") is None:
            sys.exit("--profile needs py-spy (pip install py-spy)")
        os.makedirs(args.profile, exist_ok=True)
        prof = served(args, 300, os.path.join(tmp, "serve-profiled.log"), args.profile)
        print(f"profiled phase (py-spy slows it): TTFT {prof['ttft_ms']:.1f} ms, TPOT {prof['tpot_ms']:.2f} ms")
        for name in ("api_server", "engine_core"):
            print(f"{name} (inclusive share of each thread's samples, idle included):")
            print(summarize_profile(os.path.join(args.profile, f"{name}.txt")))
    med = lambda rows, k: statistics.median(x[k] for x in rows)  # noqa: E731
    head = {k: round(med(serve, k), 2) for k in serve[0]}
    if inproc:
        head.update({f"inproc_{k}": round(med(inproc, k), 2) for k in inproc[0]})
        head["ttft_minus_prefill_ms"] = round(head["ttft_ms"] - head["inproc_prefill_ms"], 1)
        head["tpot_over_step"] = round(head["tpot_ms"] / head["inproc_step_ms"], 3)
    print(f"\nconcurrency 1, {args.input_len} in / {args.output_len} out, {args.rounds} round(s) of "
          f"{args.requests} requests; medians")
    if inproc:
        print(f"  in-process: prefill {head['inproc_prefill_ms']:.1f} ms, decode step {head['inproc_step_ms']:.2f} ms "
              f"(mean {head['inproc_step_mean_ms']:.2f}), output processing {head['inproc_output_processing_us']:.0f} us")
    print(f"  served:     TTFT {head['ttft_ms']:.1f} ms (server: queue {head['srv_queue_ms']:.1f}, prefill + "
          f"return {head['srv_prefill_ms']:.1f}, arrival to first token {head['srv_ttft_ms']:.1f}), "
          f"TPOT {head['tpot_ms']:.2f} ms (server ITL {head['srv_itl_ms']:.2f})")
    if "srv_step_ms" in head:
        print(f"  inside the server's engine: decode step {head['srv_step_ms']:.2f} ms, prefill step "
              f"{head['srv_prefill_step_ms']:.1f} ms, the loop between two steps {head['srv_loop_gap_us']:.0f} us "
              f"(of which encoding + sending the outputs {head.get('srv_send_us', float('nan')):.0f} us)")
    print(f"  CPU per output token: API server {head['api_cpu_us_per_tok']:.0f} us, engine core "
          f"{head['engine_cpu_us_per_tok']:.0f} us (main thread {head['engine_main_cpu_us_per_tok']:.0f}), "
          f"client {head['client_cpu_us_per_tok']:.0f} us; waiting for a CPU: API server "
          f"{head['api_wait_us_per_tok']:.0f} us, engine {head['engine_wait_us_per_tok']:.0f} us")
    print(f"  in the kernel: API server {100 * head['api_sys_share']:.0f} %, engine {100 * head['engine_sys_share']:.0f} % "
          f"of their CPU time; context switches per token: API server {head['api_cs_per_tok']:.1f} "
          f"({head['api_invol_cs_per_tok']:.2f} preempted), engine {head['engine_cs_per_tok']:.1f} "
          f"({head['engine_invol_cs_per_tok']:.2f} preempted)")
    if inproc:
        print(f"  TTFT - in-process prefill: {head['ttft_minus_prefill_ms']:.1f} ms (target <= 10); "
              f"TPOT / in-process step: {head['tpot_over_step']:.3f} (target <= 1.15)")
    print(json.dumps(head))


if __name__ == "__main__":
    main()

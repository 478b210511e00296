"""How the scheduler splits each step's token budget between waiting prefills and running decodes
under load, and what that does to the first token (issue 30 item 5), one run.

For each scheduling policy (LANE_SCHEDULER_POLICY: decode-first, vLLM's order, or prefill-first)
and each --max-num-batched-tokens budget, `lane serve` (its defaults otherwise: the packaged
SmolLM2 Q4_1, --quantization auto) is driven at each concurrency with random 256-token prompts and
128 output tokens (ignore_eos, greedy) by one client (`vllm bench serve` where the vLLM venv is set
up, else `lane bench`), while the engine writes its step log (LANE_STEP_LOG). Printed per policy,
budget and level: output tok/s, mean / median TTFT, mean TPOT, and from the step log: steps, the
budget's use (prefill tokens and decode rows a step, the share of steps that mix both), and the
mean step time of pure-prefill, mixed and pure-decode steps.

    python benchmarks/scheduler_budget.py [--concurrency 8 32 64] [--budgets 512 1024 2048 4096]
                                          [--policies decode-first prefill-first] [--rounds 1]

With --rounds N every configuration is run N times, interleaved (the figures are medians). The last
line is a JSON object: per configuration and level, the client's figures and the split.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers import free_port, smollm_hf_dir, vllm_python  # noqa: E402
from serving import SERVED_NAME, Client, say, stop, wait_ready, warm_up  # noqa: E402


def split(rows: list[dict]) -> dict:
    """How the budget went, over a level's steps."""
    if not rows:
        return {}
    dur = lambda r: r["sched_ms"] + r["exec_ms"] + r["update_ms"]  # noqa: E731
    kinds = {"prefill": [r for r in rows if r["prefill_tokens"] and not r["decode_rows"]],
             "mixed": [r for r in rows if r["prefill_tokens"] and r["decode_rows"]],
             "decode": [r for r in rows if not r["prefill_tokens"]]}
    with_prefill = kinds["prefill"] + kinds["mixed"]
    out = {"steps": len(rows),
           "prefill_tok_per_step": statistics.fmean(r["prefill_tokens"] for r in with_prefill) if with_prefill else 0.0,
           "decode_rows_per_step": statistics.fmean(r["decode_rows"] for r in rows),
           "mixed_share": len(kinds["mixed"]) / len(rows),
           "prefill_steps": len(with_prefill)}
    for k, rs in kinds.items():
        out[f"{k}_step_ms"] = statistics.fmean(dur(r) for r in rs) if rs else float("nan")
    return out


def run_config(args, client: Client, policy: str, budget: int, tmp: str, tag: str) -> dict[int, dict]:
    port = free_port()
    log = os.path.join(tmp, f"lane-{tag}.log")
    steps_path = os.path.join(tmp, f"steps-{tag}.jsonl")
    argv = [sys.executable, "-m", "lane.entrypoints.cli", "serve", "--port", str(port), "--served-model-name",
            SERVED_NAME, "--max-num-batched-tokens", str(budget)]
    env = {**os.environ, "LANE_LOGGING_LEVEL": "WARNING", "LANE_SCHEDULER_POLICY": policy,
           "LANE_STEP_LOG": steps_path}
    proc = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    out = {}
    try:
        wait_ready(url, proc, "lane", 600, log)
        warm_up(url, args.output_len)
        for c in args.concurrency:
            n = 4 * c if c <= 8 else 2 * c
            t0 = time.monotonic()
            s = client.run(url, c, n, tag)
            t1 = time.monotonic()
            time.sleep(1.2)  # the step log is flushed within a second
            with open(steps_path) as f:
                rows = [r for r in map(json.loads, filter(str.strip, f)) if t0 <= r["t"] <= t1]
            s.update(split(rows))
            out[c] = s
            say(f"  {policy} budget {budget} c={c}: {s['output_throughput']:.1f} tok/s, TTFT {s['mean_ttft_ms']:.0f} "
                f"ms, TPOT {s['mean_tpot_ms']:.1f} ms, {s.get('prefill_tok_per_step', 0):.0f} prefill tokens and "
                f"{s.get('decode_rows_per_step', 0):.1f} decodes a step")
    finally:
        stop(proc)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    ap.add_argument("--policies", nargs="+", default=["decode-first", "prefill-first"],
                    choices=["decode-first", "prefill-first"])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--client", default="auto", choices=["auto", "vllm", "lane"])
    args = ap.parse_args()
    vllm_py = vllm_python()
    kind = args.client if args.client != "auto" else ("vllm" if vllm_py else "lane")
    tmp = tempfile.mkdtemp(prefix="scheduler-budget-")
    client = Client(kind, vllm_py, smollm_hf_dir(), args, tmp)
    say(f"client: {'vllm bench serve' if kind == 'vllm' else 'lane bench'}; logs in {tmp}")
    runs: dict[tuple[str, int], list[dict[int, dict]]] = {}
    for r in range(args.rounds):
        for policy in args.policies:
            for budget in args.budgets:
                runs.setdefault((policy, budget), []).append(
                    run_config(args, client, policy, budget, tmp, f"{policy}-{budget}-r{r}"))

    def med(key, rows):
        vals = [x[key] for x in rows if x.get(key) is not None]
        return statistics.median(vals) if vals else float("nan")

    print(f"\nrandom {args.input_len} in / {args.output_len} out, {args.rounds} round(s) (medians); per step: prefill "
          f"tokens (in steps with any), decode rows, share of steps mixing both, mean step ms by kind")
    print(f"{'policy':<13} {'budget':>6} {'conc':>4} {'tok/s':>7} {'TTFT mean':>9} {'P50':>7} {'TPOT':>6} "
          f"{'steps':>6} {'pf tok':>6} {'dec rows':>8} {'mixed':>5} {'pf ms':>7} {'mix ms':>7} {'dec ms':>6}")
    table = {}
    for (policy, budget), rounds in runs.items():
        for c in args.concurrency:
            rows = [r[c] for r in rounds]
            keys = ("output_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "steps",
                    "prefill_tok_per_step", "decode_rows_per_step", "mixed_share", "prefill_step_ms",
                    "mixed_step_ms", "decode_step_ms")
            m = {k: med(k, rows) for k in keys}
            table[f"{policy}:{budget}:c{c}"] = {k: round(v, 2) for k, v in m.items()}
            print(f"{policy:<13} {budget:>6} {c:>4} {m['output_throughput']:>7.1f} {m['mean_ttft_ms']:>9.0f} "
                  f"{m['median_ttft_ms']:>7.0f} {m['mean_tpot_ms']:>6.1f} {m['steps']:>6.0f} "
                  f"{m['prefill_tok_per_step']:>6.0f} {m['decode_rows_per_step']:>8.1f} {100 * m['mixed_share']:>4.0f}% "
                  f"{m['prefill_step_ms']:>7.1f} {m['mixed_step_ms']:>7.1f} {m['decode_step_ms']:>6.1f}")
    print(json.dumps(table))


if __name__ == "__main__":
    main()

"""What a run leaves behind: the console table (vllm bench serve's layout), a JSON
summary, a per-request CSV, PNG plots; and `lane bench compare`."""
from __future__ import annotations

import csv
import json
import os

from lane.bench.metrics import metric_values, timeline
from lane.bench.request import RequestOutput

NAMES = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
         "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}


def _row(label: str, value) -> str:
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}"
    return f"{label:<40} {value!s:<10}"


def format_table(r: dict, selected: list[str], percentiles: list[float]) -> str:
    lines = [" Serving Benchmark Result ".center(50, "=")]
    lines.append(_row("Successful requests:", r["completed"]))
    lines.append(_row("Failed requests:", r["failed"]))
    if r.get("max_concurrency"):
        lines.append(_row("Maximum request concurrency:", r["max_concurrency"]))
    lines.append(_row("Request rate configured (RPS):", r["request_rate"]))
    lines.append(_row("Benchmark duration (s):", r["duration"]))
    lines.append(_row("Total input tokens:", r["total_input_tokens"]))
    lines.append(_row("Total generated tokens:", r["total_output_tokens"]))
    lines.append(_row("Request throughput (req/s):", r["request_throughput"]))
    if r.get("request_goodput") is not None:
        lines.append(_row("Request goodput (req/s):", r["request_goodput"]))
    lines.append(_row("Input token throughput (tok/s):", r["input_throughput"]))
    lines.append(_row("Output token throughput (tok/s):", r["output_throughput"]))
    lines.append(_row("Total token throughput (tok/s):", r["total_token_throughput"]))
    for name in selected:
        title, short = NAMES[name]
        lines.append(title.center(50, "-"))
        lines.append(_row(f"Mean {short} (ms):", r[f"mean_{name}_ms"]))
        lines.append(_row(f"Median {short} (ms):", r[f"median_{name}_ms"]))
        lines.append(_row(f"Std {short} (ms):", r[f"std_{name}_ms"]))
        for p in percentiles:
            lines.append(_row(f"P{p:g} {short} (ms):", r[f"p{p:g}_{name}_ms"]))
        lines.append(_row(f"Max {short} (ms):", r[f"max_{name}_ms"]))
    if "prefix_cache_queries" in r:
        lines.append("Prefix Cache (this run)".center(50, "-"))
        lines.append(_row("Queried tokens:", r["prefix_cache_queries"]))
        lines.append(_row("Hit tokens:", r["prefix_cache_hits"]))
        lines.append(_row("Hit rate (%):", 100 * r["prefix_cache_hit_rate"]))
        if r.get("kv_block_size"):
            lines.append(_row("KV block size (tokens):", r["kv_block_size"]))
    if "spec_decode_num_drafts" in r:
        lines.append("Speculative Decoding (this run)".center(50, "-"))
        lines.append(_row("Drafts:", r["spec_decode_num_drafts"]))
        lines.append(_row("Draft tokens:", r["spec_decode_draft_tokens"]))
        lines.append(_row("Accepted tokens:", r["spec_decode_accepted_tokens"]))
        lines.append(_row("Acceptance rate (%):", 100 * r["spec_decode_acceptance_rate"]))
        lines.append(_row("Acceptance length:", r["spec_decode_acceptance_length"]))
    for w in r.get("warnings", []):
        lines.append(f"warning: {w}")
    lines.append("=" * 50)
    return "\n".join(lines)


def write_csv(path: str, outputs: list[RequestOutput]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["index", "success", "start_time_s", "ttft_ms", "tpot_ms", "e2el_ms", "input_tokens",
                    "output_tokens", "mean_itl_ms", "max_itl_ms", "num_chunks", "error"])
        for i, o in enumerate(outputs):
            itl_ms = [x * 1000 for x in o.itl]
            w.writerow([i, o.success, f"{o.start_time:.4f}", f"{o.ttft * 1000:.2f}",
                        f"{o.tpot * 1000:.2f}" if o.tpot is not None else "", f"{o.latency * 1000:.2f}",
                        o.prompt_len, o.output_tokens, f"{sum(itl_ms) / len(itl_ms):.2f}" if itl_ms else "",
                        f"{max(itl_ms):.2f}" if itl_ms else "", len(o.chunk_times), o.error])


def write_plots(result_dir: str, outputs: list[RequestOutput], duration: float, title: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    values = metric_values(outputs)
    paths = []
    for name, label in (("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)")):
        fig, ax = plt.subplots(figsize=(7, 4))
        vals = values[name]
        if vals:
            ax.hist(vals, bins=min(40, max(5, len(vals) // 2)), color="#4477aa", edgecolor="white")
            for q, style in ((50, "--"), (99, ":")):
                v = sorted(vals)[min(len(vals) - 1, int(len(vals) * q / 100))]
                ax.axvline(v, color="#cc3311", linestyle=style, label=f"P{q} {v:.1f} ms")
            ax.legend()
        ax.set(xlabel=label, ylabel="requests")
        ax.set_title(f"{label.split()[0]} distribution\n{title}", fontsize=9)
        path = os.path.join(result_dir, f"{name}_distribution.png")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    tl = timeline(outputs, duration)
    for key, label, fname in (("output_tok_s", "output tokens/s", "throughput_over_time.png"),
                              ("concurrency", "requests in flight", "concurrency_over_time.png")):
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(tl["t"], tl[key], drawstyle="steps-post", color="#228833")
        ax.set(xlabel="time since start (s)", ylabel=label)
        ax.set_title(f"{label} over time\n{title}", fontsize=9)
        ax.set_ylim(bottom=0)
        path = os.path.join(result_dir, fname)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def save(result_dir: str, result: dict, outputs: list[RequestOutput], title: str,
         json_name: str = "summary.json") -> list[str]:
    os.makedirs(result_dir, exist_ok=True)
    json_path = os.path.join(result_dir, json_name)
    with open(json_path, "w") as f:
        json.dump(result, f, indent=2)
    csv_path = os.path.join(result_dir, "requests.csv")
    write_csv(csv_path, outputs)
    return [json_path, csv_path, *write_plots(result_dir, outputs, result["duration"], title)]


# -- lane bench compare ----------------------------------------------------------

COMPARE_KEYS = [  # (key, label, higher is better)
    ("completed", "completed requests", True), ("failed", "failed requests", False),
    ("duration", "duration (s)", False), ("request_throughput", "request throughput (req/s)", True),
    ("output_throughput", "output throughput (tok/s)", True),
    ("total_token_throughput", "total throughput (tok/s)", True),
    ("mean_ttft_ms", "mean TTFT (ms)", False), ("median_ttft_ms", "median TTFT (ms)", False),
    ("p99_ttft_ms", "P99 TTFT (ms)", False), ("mean_tpot_ms", "mean TPOT (ms)", False),
    ("median_tpot_ms", "median TPOT (ms)", False), ("p99_tpot_ms", "P99 TPOT (ms)", False),
    ("mean_itl_ms", "mean ITL (ms)", False), ("p99_itl_ms", "P99 ITL (ms)", False),
    ("mean_e2el_ms", "mean E2EL (ms)", False), ("p99_e2el_ms", "P99 E2EL (ms)", False),
    ("prefix_cache_hit_rate", "prefix-cache hit rate", True),
]


def compare(path_a: str, path_b: str) -> str:
    """Two runs side by side (lane bench's summary.json or vllm bench serve's --save-result
    JSON: the aggregate keys are the same), with B / A."""
    runs = []
    for p in (path_a, path_b):
        with open(p) as f:
            runs.append(json.load(f))
    a, b = runs
    names = [os.path.basename(p) for p in (path_a, path_b)]
    if names[0] == names[1]:  # two summary.json: name them by their folders
        names = [os.path.join(os.path.basename(os.path.dirname(os.path.abspath(p))), n)
                 for p, n in zip((path_a, path_b), names)]
    w = max(len(names[0]), len(names[1]), 12)
    lines = [f"{'':<30} {names[0]:>{w}} {names[1]:>{w}} {'B / A':>8}"]
    for key, label, _ in COMPARE_KEYS:
        if not isinstance(a.get(key), (int, float)) or not isinstance(b.get(key), (int, float)):
            continue
        ratio = f"{b[key] / a[key]:.2f}" if a[key] else "-"
        lines.append(f"{label:<30} {a[key]:>{w}.2f} {b[key]:>{w}.2f} {ratio:>8}")
    return "\n".join(lines)

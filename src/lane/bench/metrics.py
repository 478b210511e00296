"""Aggregate figures of a run, named as vllm bench serve names them in its JSON
(mean_ttft_ms, p99_tpot_ms, output_throughput, ...), so runs of both tools compare."""
from __future__ import annotations

import statistics

from lane.bench.request import RequestOutput

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def metric_values(outputs: list[RequestOutput]) -> dict[str, list[float]]:
    ok = [o for o in outputs if o.success]
    return {"ttft": [o.ttft * 1000 for o in ok],
            "tpot": [o.tpot * 1000 for o in ok if o.tpot is not None],
            "itl": [x * 1000 for o in ok for x in o.itl],
            "e2el": [o.latency * 1000 for o in ok]}


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (ms; also e2el)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] <= 0:
            raise ValueError(f"--goodput {item!r}: the limit must be positive")
    return slos


def meets_slos(o: RequestOutput, slos: dict[str, float]) -> bool:
    vals = {"ttft": o.ttft * 1000, "e2el": o.latency * 1000,
            "tpot": (o.tpot or 0.0) * 1000}
    return all(vals[k] <= v for k, v in slos.items())


def calculate_metrics(outputs: list[RequestOutput], duration: float, percentiles: list[float],
                      selected: list[str], slos: dict[str, float]) -> dict:
    ok = [o for o in outputs if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    m: dict = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "request_goodput": (sum(meets_slos(o, slos) for o in ok) / duration if duration else 0.0)
        if slos else None,
        "input_throughput": total_in / duration if duration else 0.0,
        "output_throughput": total_out / duration if duration else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration else 0.0,
    }
    values = metric_values(outputs)
    for name in selected:
        vals = values[name]
        m[f"mean_{name}_ms"] = statistics.fmean(vals) if vals else 0.0
        m[f"median_{name}_ms"] = statistics.median(vals) if vals else 0.0
        m[f"std_{name}_ms"] = statistics.pstdev(vals) if len(vals) > 1 else 0.0
        for p in percentiles:
            m[f"p{p:g}_{name}_ms"] = percentile(vals, p)
        m[f"max_{name}_ms"] = max(vals) if vals else 0.0
    return m


def timeline(outputs: list[RequestOutput], duration: float, step: float = 1.0) -> dict[str, list[float]]:
    """Output tokens/s and requests in flight, per `step` seconds of the run."""
    n = max(1, int(duration / step) + 1)
    tok = [0.0] * n
    conc = [0.0] * n
    for o in outputs:
        if o.chunk_times:
            per_chunk = o.output_tokens / len(o.chunk_times) if o.output_tokens else 1.0
            for t in o.chunk_times:
                tok[min(int(t / step), n - 1)] += per_chunk / step
        end = o.start_time + (o.latency or 0.0)
        for i in range(n):  # share of each bin this request was in flight
            lo, hi = i * step, (i + 1) * step
            conc[i] += max(0.0, min(hi, end) - max(lo, o.start_time)) / step
    return {"t": [i * step for i in range(n)], "output_tok_s": tok, "concurrency": conc}

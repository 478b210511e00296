"""The server's own counters, read from /metrics before and after a run, so the figures
are this run's (a vLLM or lane server's counters are cumulative since its start)."""
from __future__ import annotations

import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families

COUNTERS = {
    "prefix_cache_queries": "vllm:prefix_cache_queries",
    "prefix_cache_hits": "vllm:prefix_cache_hits",
    "spec_decode_num_drafts": "vllm:spec_decode_num_drafts",
    "spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}


def scrape(base_url: str, headers: dict[str, str] | None = None) -> dict | None:
    """Counter totals and the KV block size, or None when the server has no /metrics."""
    try:
        r = httpx.get(base_url + "/metrics", headers=headers, timeout=10)
        if r.status_code != 200:
            return None
        families = list(text_string_to_metric_families(r.text))
    except (httpx.HTTPError, ValueError):
        return None
    out: dict = {"block_size": None}
    for fam in families:
        for key, name in COUNTERS.items():
            if fam.name not in (name, name + "_total"):
                continue
            # a labelled counter has samples only once the server has counted (a server that
            # never speculated has no spec samples): an absent key means "not measured", not 0
            samples = [s.value for s in fam.samples if s.name.endswith("_total") or s.name == name]
            if samples:
                out[key] = out.get(key, 0.0) + sum(samples)
        if fam.name == "vllm:cache_config_info":
            for s in fam.samples:
                if "block_size" in s.labels:
                    out["block_size"] = int(s.labels["block_size"])
    return out


def run_delta(before: dict | None, after: dict | None) -> dict:
    """This run's prefix-cache and speculative-decoding figures."""
    if before is None or after is None:
        return {}
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in COUNTERS if k in after}
    res: dict = {"kv_block_size": after.get("block_size")}
    if "prefix_cache_queries" in d:
        q, h = d["prefix_cache_queries"], d.get("prefix_cache_hits", 0.0)
        res.update(prefix_cache_queries=int(q), prefix_cache_hits=int(h),
                   prefix_cache_hit_rate=h / q if q else 0.0)
    if "spec_decode_num_drafts" in d:  # a speculating server: its figures even when this run drafted none
        drafts = d["spec_decode_num_drafts"]
        proposed = d.get("spec_decode_num_draft_tokens", 0.0)
        accepted = d.get("spec_decode_num_accepted_tokens", 0.0)
        res.update(spec_decode_num_drafts=int(drafts), spec_decode_draft_tokens=int(proposed),
                   spec_decode_accepted_tokens=int(accepted),
                   spec_decode_acceptance_rate=accepted / proposed if proposed else 0.0,
                   # vLLM's definition: tokens per draft step, the bonus token included
                   spec_decode_acceptance_length=1 + accepted / drafts if drafts else 1.0)
    return res

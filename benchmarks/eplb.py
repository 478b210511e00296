"""EPLB on this machine (issue 31): a skewed MoE at TP=2 + EP, before and after rebalancing, the
moves' cost, the running streams' inter-token latency while experts move, and a projection of
the move to the seed's deployment.

The models are random DeepSeek V3 and V4 checkpoints (SmolLM2's tokenizer, written once under
~/.cache/lane/bench-eplb) whose routing bias favours a quarter of the experts, E/4 .. E/2 - 1: all
in rank 0's initial slots, none of them given a redundant slot by the initial map (which
replicates experts 0, 1, ...), so the placement EPLB starts from is as unbalanced as it gets.

1. Offline (`LLM`, two worker processes, gloo): decode-heavy batches cross several
   `step_interval`s; from the engine's trace: balancedness and the busiest rank's expert tokens
   per step over each window (seed step 53), each rearrangement's time, experts and bytes moved
   (step 54); and, timing every engine step, the decode step's mean before the first
   rearrangement against after it (steps that moved weights left out).
2. Online (`lane serve`, same model): 16 streams; the P99 and max inter-token latency without
   EPLB, with EPLB moving every layer between two steps (sync), and with `use_async` (one layer
   a step), rearranging every few steps so moves happen throughout.
3. Projection: the measured slots moved per layer and the gloo loopback transfer rate, applied to
   V4-Flash's sizes on the seed's 16 EP ranks (stated device model: link bandwidth and latency
   per transfer, assumed), every 600 steps: the sync stall, the per-layer async stall, and their
   cost amortized over the interval.

    python benchmarks/eplb.py [--archs deepseek_v3 deepseek_v4] [--skip-serve]

The last line is a JSON object of the headline figures. A few minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import httpx2 as httpx
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offline_throughput import check_quiet  # noqa: E402

ROOT = os.path.expanduser(os.path.join("~", ".cache", "lane", "bench-eplb"))
SIZES = {  # bigger than the test models, so an expert is worth moving: 16 experts, 4 a token
    "deepseek_v3": dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=512, num_hidden_layers=5,
                        n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2),
    "deepseek_v4": dict(n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=256),
}
# V4-Flash (DEEPSEEK_V4.md) on the seed's deployment: 16 EP ranks, a rearrangement every 600 steps
SEED = dict(moe_layers=43, experts=256, hidden=4096, expert_inter=2048, ep=16, interval=600,
            redundant=16, bits_per_weight=4.25)  # fp4 routed experts with one 8-bit scale per 32
# assumed links between two ranks (one direction) and the fixed cost of a transfer
DEVICES = {"H200 NVLink": (450e9, 10e-6), "Ascend 910 HCCS (seed's cards, as published)": (56e9, 20e-6)}


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def skewed_model(arch: str) -> str:
    """The arch's benchmark checkpoint, its routing bias steering tokens to experts E/4 .. E/2 - 1."""
    from safetensors.torch import load_file, save_file

    from lane.entrypoints.tiny_model import write_tiny_model

    out = os.path.join(ROOT, arch)
    if os.path.exists(os.path.join(out, "skewed-e4")):
        return out
    say(f"writing {arch}'s benchmark model to {out} ...")
    write_tiny_model(arch, out, seed=0, **SIZES[arch])
    E = SIZES[arch]["n_routed_experts"]
    path = os.path.join(out, "model.safetensors")
    tensors = load_file(path)
    for name, t in tensors.items():
        if name.endswith(("e_score_correction_bias", "gate.bias")):
            t.zero_()
            t[E // 4:E // 2] = 3.0
    save_file(tensors, path, metadata={"format": "pt"})
    open(os.path.join(out, "skewed-e4"), "w").close()
    return out


def offline(arch: str, interval: int, redundant: int) -> dict:
    """Part 1: one LLM at TP=2 + EP + EPLB, traced, every engine step timed."""
    from lane import LLM, SamplingParams
    from lane.tracing import Step, tracer

    model = skewed_model(arch)
    tracer.enable()
    try:
        llm = LLM(model, dtype="float32", tensor_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
                  eplb_config=dict(window_size=interval, step_interval=interval, num_redundant_experts=redundant),
                  max_num_batched_tokens=256, show_progress=False)
        g = torch.Generator().manual_seed(0)
        params = SamplingParams(temperature=0, max_tokens=4 * interval, ignore_eos=True)
        for p in torch.randint(100, 49152, (16, 32), generator=g).tolist():  # 2 prefill steps, then decodes
            llm._add_request({"prompt_token_ids": p}, params)
        check_quiet()
        steps = []  # (seconds, rearrangements so far, decoding only)
        t0 = time.perf_counter()
        while llm.output_processor.has_unfinished():
            decoding = not llm.engine.scheduler.waiting and all(
                r.num_computed_tokens >= r.num_prompt_tokens for r in llm.engine.scheduler.running)
            t = time.perf_counter()
            llm._step()
            events = llm.engine.eplb_stats.rebalance_events if llm.engine.eplb_stats else 0
            steps.append((time.perf_counter() - t, events, decoding))
        wall = time.perf_counter() - t0
        llm.shutdown()
    finally:
        spans = tracer.drain()
        tracer.enabled, tracer.rank = False, None
    collects = sorted((s for s in spans if s.step == Step.EPLB_COLLECT and s.attrs.get("rank") == 0),
                      key=lambda s: s.start)
    moves = sorted((s for s in spans if s.step == Step.EPLB_REBALANCE and s.attrs.get("rank") == 0),
                   key=lambda s: s.start)
    # a step whose count of rearrangements went up moved weights: left out of both sides
    moved = {i for i in range(1, len(steps)) if steps[i][1] != steps[i - 1][1]}
    before = [dt * 1e3 for i, (dt, n, dec) in enumerate(steps) if dec and n == 0 and i not in moved]
    after = [dt * 1e3 for i, (dt, n, dec) in enumerate(steps) if dec and n >= 1 and i not in moved]
    windows = [dict(balancedness_min=c.attrs["balancedness_min"], balancedness_p50=c.attrs["balancedness_p50"],
                    max_rank_tokens_per_step=max(c.attrs["rank_tokens"]) / c.attrs["window_steps"],
                    mean_rank_tokens_per_step=sum(c.attrs["rank_tokens"]) / 2 / c.attrs["window_steps"])
               for c in collects]
    P = SIZES[arch]["n_routed_experts"] + redundant
    moe_layers = collects[0].attrs["layers"] if collects else 0
    return dict(arch=arch, wall_s=wall, windows=windows,
                moves=[dict(ms=m.attrs["ms"], experts=m.attrs["experts_moved"], bytes=m.attrs["bytes"],
                            layers=m.attrs["layers_moved"], local_copies=m.attrs["local_copies"]) for m in moves],
                decode_ms_before=statistics.median(before) if before else float("nan"),
                decode_ms_after=statistics.median(after) if after else float("nan"),
                slots=P, moe_layers=moe_layers)


def stream_itls(url: str, prompts: list[list[int]], max_tokens: int) -> list[float]:
    """16 streams at once; every gap between two text chunks of a stream, in ms."""
    def one(p):
        gaps, last = [], None
        with httpx.stream("POST", url + "/v1/completions", timeout=300, json={
                "model": "m", "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append((now - last) * 1e3)
                    last = now
        return gaps

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return [g for gaps in pool.map(one, prompts) for g in gaps]


def online(arch: str, interval: int, redundant: int) -> dict:
    """Part 2: lane serve without EPLB, with sync moves and with async moves."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from utils import RemoteServer

    model = skewed_model(arch)
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(100, 49152, (16, 24), generator=g).tolist()
    base = ["--model", model, "--dtype", "float32", "-tp", "2", "--enable-expert-parallel",
            "--served-model-name", "m", "--max-num-batched-tokens", "256"]
    runs = {"off": [], "sync": ["--enable-eplb", "--eplb-config", json.dumps(
        dict(window_size=interval, step_interval=interval, num_redundant_experts=redundant))],
            "async": ["--enable-eplb", "--eplb-config", json.dumps(
        dict(window_size=interval, step_interval=interval, num_redundant_experts=redundant, use_async=True))]}
    out = {}
    for name, extra in runs.items():
        with RemoteServer(base + extra) as s:
            stream_itls(s.url, prompts[:2], 4)  # warm
            check_quiet()
            itl = sorted(stream_itls(s.url, prompts, 96))
            metrics = httpx.get(s.url + "/metrics").text
        events = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                     if line.startswith("vllm:eplb_rebalance_events_total{"))
        out[name] = dict(p50_itl_ms=itl[len(itl) // 2], p99_itl_ms=itl[min(len(itl) - 1, int(0.99 * len(itl)))],
                         max_itl_ms=itl[-1], rearrangements=int(events))
        say(f"  {arch} serve, EPLB {name}: ITL P50 {out[name]['p50_itl_ms']:.1f} ms, P99 "
            f"{out[name]['p99_itl_ms']:.1f} ms, max {out[name]['max_itl_ms']:.1f} ms, {int(events)} rearrangements")
    return out


def projection(measured: dict) -> dict:
    """Part 3: the seed's move, from this run's share of slots moved per layer and the devices'
    stated links. Returns per device: bytes a rank receives per layer, sync stall, async stall."""
    s = SEED
    P = s["experts"] + s["redundant"]
    expert_bytes = 3 * s["hidden"] * s["expert_inter"] * s["bits_per_weight"] / 8
    share = measured["moved_share"]  # slots whose expert came from another rank, per layer, measured
    per_rank_experts = share * P / s["ep"]  # arrivals per rank per layer
    out = {"expert_mib": round(expert_bytes / 2**20, 2), "slots_moved_per_rank_per_layer": round(per_rank_experts, 2)}
    for name, (bw, lat) in DEVICES.items():
        layer_s = per_rank_experts * (expert_bytes / bw + lat)
        out[name] = dict(layer_ms=round(layer_s * 1e3, 3), sync_stall_ms=round(layer_s * s["moe_layers"] * 1e3, 2),
                         async_step_ms=round(layer_s * 1e3, 3),
                         amortized_us_per_step=round(layer_s * s["moe_layers"] / s["interval"] * 1e6, 1))
    cpu_bps = measured["cpu_bytes_per_s"]
    out["this CPU's gloo loopback"] = dict(
        rate_gb_s=round(cpu_bps / 1e9, 3),
        sync_stall_ms=round(per_rank_experts * expert_bytes / cpu_bps * s["moe_layers"] * 1e3, 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", nargs="+", default=["deepseek_v3", "deepseek_v4"], choices=list(SIZES))
    ap.add_argument("--interval", type=int, default=24, help="window_size and step_interval (steps)")
    ap.add_argument("--redundant", type=int, default=4, help="num_redundant_experts")
    ap.add_argument("--skip-serve", action="store_true", help="no lane serve runs (part 2)")
    args = ap.parse_args()
    head: dict = {}
    moved_slots = moved_bytes = moved_s = 0.0
    total_slot_layers = 0
    for arch in args.archs:
        say(f"{arch}: offline, TP=2 + EP + EPLB every {args.interval} steps, {args.redundant} redundant experts")
        r = offline(arch, args.interval, args.redundant)
        print(f"\n{arch} (TP=2 + EP, {r['slots']} slots per MoE layer, {r['moe_layers']} MoE layers; wall "
              f"{r['wall_s']:.1f} s)")
        print(f"  {'window':>6} {'bal. min':>8} {'bal. p50':>8} {'busiest rank tok/step':>21} {'mean rank tok/step':>18}")
        for i, w in enumerate(r["windows"]):
            print(f"  {i:>6} {w['balancedness_min']:>8.3f} {w['balancedness_p50']:>8.3f} "
                  f"{w['max_rank_tokens_per_step']:>21.1f} {w['mean_rank_tokens_per_step']:>18.1f}")
        for i, m in enumerate(r["moves"]):
            print(f"  rearrangement {i + 1}: {m['ms']:.1f} ms, {m['experts']} experts sent ({m['bytes'] / 2**20:.2f} MiB), "
                  f"{m['local_copies']} local copies, {m['layers']} layers changed")
        print(f"  decode step: {r['decode_ms_before']:.2f} ms before the first rearrangement, "
              f"{r['decode_ms_after']:.2f} ms after the last ({r['decode_ms_before'] / r['decode_ms_after']:.2f}x)")
        key = arch.replace("deepseek_", "")
        w0, w1 = r["windows"][0], r["windows"][-1]
        head.update({f"{key}_balancedness_before": w0["balancedness_min"], f"{key}_balancedness_after": w1["balancedness_min"],
                     f"{key}_busiest_rank_tok_step_before": round(w0["max_rank_tokens_per_step"], 1),
                     f"{key}_busiest_rank_tok_step_after": round(w1["max_rank_tokens_per_step"], 1),
                     f"{key}_decode_ms_before": round(r["decode_ms_before"], 3),
                     f"{key}_decode_ms_after": round(r["decode_ms_after"], 3),
                     f"{key}_first_move_ms": r["moves"][0]["ms"] if r["moves"] else None,
                     f"{key}_first_move_bytes": r["moves"][0]["bytes"] if r["moves"] else 0})
        for m in r["moves"]:
            moved_slots += m["experts"]
            moved_bytes += m["bytes"]
            moved_s += m["ms"] / 1e3
            total_slot_layers += r["slots"] * r["moe_layers"]
        if not args.skip_serve:
            on = online(arch, max(4, args.interval // 4), args.redundant)
            print(f"  lane serve, 16 streams x 96 tokens: ITL P99 / max (ms): without EPLB "
                  f"{on['off']['p99_itl_ms']:.1f} / {on['off']['max_itl_ms']:.1f}, sync moves "
                  f"{on['sync']['p99_itl_ms']:.1f} / {on['sync']['max_itl_ms']:.1f} ({on['sync']['rearrangements']} "
                  f"rearrangements), async {on['async']['p99_itl_ms']:.1f} / {on['async']['max_itl_ms']:.1f} "
                  f"({on['async']['rearrangements']})")
            for name in ("off", "sync", "async"):
                head[f"{key}_itl_p99_ms_{name}"] = round(on[name]["p99_itl_ms"], 2)
                head[f"{key}_itl_max_ms_{name}"] = round(on[name]["max_itl_ms"], 2)
    if total_slot_layers and moved_s:
        proj = projection({"moved_share": moved_slots / total_slot_layers, "cpu_bytes_per_s": moved_bytes / moved_s})
        s = SEED
        print(f"\nprojection to the seed (V4-Flash: {s['moe_layers']} MoE layers, {s['experts']} + {s['redundant']} "
              f"experts on {s['ep']} EP ranks, {s['bits_per_weight']} bits a weight, every {s['interval']} steps); "
              f"measured here: {proj['slots_moved_per_rank_per_layer']} slots arrive per rank per layer "
              f"(the share of slots sent per rearrangement), an expert is {proj['expert_mib']} MiB (assumed format):")
        for name in DEVICES:
            p = proj[name]
            print(f"  {name} (assumed link): {p['layer_ms']} ms a layer; sync stall {p['sync_stall_ms']} ms, async "
                  f"{p['async_step_ms']} ms in each of {s['moe_layers']} steps; amortized "
                  f"{p['amortized_us_per_step']} us a step")
            head[f"seed_sync_stall_ms_{name.split()[0]}"] = p["sync_stall_ms"]
        c = proj["this CPU's gloo loopback"]
        print(f"  this CPU's gloo loopback (measured {c['rate_gb_s']} GB/s of moved bytes over the moves' time): "
              f"sync stall {c['sync_stall_ms']} ms")
        head["cpu_move_gb_s"] = c["rate_gb_s"]
    print(json.dumps(head))


if __name__ == "__main__":
    main()

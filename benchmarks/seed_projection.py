"""The seed's deployment projected to its real size: DeepSeek V4-Flash at TP16 x DP2 with wide
EP, SP, DSA-CP, MTP k = 3 and an 8-bit cache, a 3.5K-token prompt prefilled in 4 chunks, PD
disaggregated; from one run of examples/seed_shape/run.sh (its trace.json) and a device model.

What comes from the run (measured):
- the request's structure: prefill chunks, decode steps, drafts per step and their acceptance
  (steps 17, 43, 47);
- the collectives: how many each layer makes per step kind, and their bytes per row and layer
  in units of the hidden size (steps 22, 26, 28, 31, 33), scaled to V4-Flash's hidden size (and
  the EP dispatch by its top-k over the tiny model's);
- the KV moved per prompt token (step 55) against what lane explain counts for the tiny model,
  that ratio applied to V4-Flash's int8 bytes per token (lane explain on its config);
- the host's time per request and per decode step (frontend, engine, scheduler, KV manager,
  runner: steps 11-20, 34-39 and 41-44, 47-50), carried over as measured here.
What is assumed: the devices (DEVICES: peak FLOP/s, HBM and link bandwidth, collective latency,
the PD link; public figures, the Ascend ones approximate) and the efficiencies (MFU, share of
HBM bandwidth), V4-Flash's storage (FP8 dense, FP4 routed experts), and that the model steps
(21-33) cost compute or memory time, whichever is larger, plus collectives, nothing more.
Derived: FLOPs and bytes of every model step from V4-Flash's config (transformers' defaults with
Flash's layer pattern: 2 SWA, then CSA and HCA alternating).

    python benchmarks/seed_projection.py [--run-dir seed_shape_run] [--decode-batch 1] [--acceptance A]

Prints each step's projected time on an H200 and on the seed's Ascend A3 NPU, TTFT and TPOT
with each phase's share; the last line is a JSON object of the headline figures.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kv_cache_dtype import config_bytes_per_token, explain_bytes_per_token  # noqa: E402

# assumed, per card (one NPU die for Ascend, as vllm-ascend counts ranks); latency: one small
# collective over the 16 ranks, as collective benchmarks report it; edit to taste
DEVICES = {
    "H200": dict(bf16_tflops=989, fp8_tflops=1979, hbm_tbps=4.8, link_gbps=450, latency_us=20, pd_gbps=50,
                 note="NVIDIA H200 SXM datasheet: dense bf16 / fp8, HBM3e, NVLink 900 GB/s both ways, as if "
                      "all 16 shared one NVLink domain (an HGX box holds 8); one 400 Gb/s NIC per GPU for PD"),
    "Ascend A3 NPU": dict(bf16_tflops=376, fp8_tflops=752, hbm_tbps=1.6, link_gbps=196, latency_us=30, pd_gbps=25,
                          note="Ascend 910-class die as in press figures (bf16, W8A8 int8 rate for the 8-bit "
                               "linears), HCCS per direction, 200 Gb/s RoCE for PD: approximate, unverified"),
}
MFU, HBM_SHARE = 0.5, 0.7  # assumed efficiencies: GEMM share of peak, share of HBM bandwidth
TP, DP = 16, 2
EP = TP * DP
PROMPT, CHUNKS = 3500, 4
FP8, FP4, BF16 = 1.0, 0.5, 2.0  # bytes per value

HOST_PREFILL = (11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 34, 35, 36, 37, 38, 39)
HOST_DECODE = (41, 42, 43, 44, 47, 48, 49, 50)
COMM = {22: "comm.sp_scatter", 26: "comm.cp_gather", 28: "comm.attn_reduce", 31: "comm.ffn_reduce",
        33: "comm.logits_gather"}


def flash_config() -> dict:
    """V4-Flash's sizes: transformers' DeepseekV4Config defaults, Flash's 43-layer pattern."""
    import transformers

    c = transformers.DeepseekV4Config().to_dict()
    n = c["num_hidden_layers"]
    c["layer_types"] = ["sliding_attention"] * 2 + [
        "compressed_sparse_attention" if i % 2 == 0 else "heavily_compressed_attention" for i in range(n - 2)]
    return c


def layer_flops(c: dict, kind: str, pos: float) -> tuple[float, float, float]:
    """(attention-side linear FLOPs, attention-core FLOPs, MoE FLOPs) per token at position pos."""
    D, H, d, qr = c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["q_lora_rank"]
    G, orank, W = c["o_groups"], c["o_lora_rank"], c["sliding_window"]
    HI, dI, topk = c["index_n_heads"], c["index_head_dim"], c["index_topk"]
    rates = c["compress_rates"]
    lin = 2 * (D * qr + qr * H * d + D * d + H * d * orank + G * orank * D)
    keys = min(W, pos)
    core = 0.0
    if kind == "compressed_sparse_attention":
        entries = pos / rates[kind]
        lin += 2 * (2 * 2 * D * d + qr * HI * dI + D * HI + 2 * 2 * D * dI)  # compressors, indexer
        core += 2 * HI * dI * entries  # the indexer's scores over every entry
        keys += min(topk, entries)
    elif kind == "heavily_compressed_attention":
        lin += 2 * 2 * D * d
        keys += pos / rates[kind]
    core += 2 * 2 * H * d * keys  # QK and PV over one shared K = V
    hc = c["hc_mult"]
    lin += 2 * 2 * hc * D * (2 + hc) * hc  # mHC mixing, both sublayers
    moe = 2 * 3 * D * c["moe_intermediate_size"] * (c["num_experts_per_tok"] + c["n_shared_experts"]) \
        + 2 * D * c["n_routed_experts"]
    return lin, core, moe


def weight_bytes(c: dict) -> tuple[float, float, float]:
    """(attention-side weights per layer, one routed expert, the shared expert) in bytes."""
    D, H, d, qr = c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["q_lora_rank"]
    attn = (D * qr + qr * H * d + D * d + H * d * c["o_lora_rank"] + c["o_groups"] * c["o_lora_rank"] * D) * FP8
    expert = 3 * D * c["moe_intermediate_size"]
    return attn, expert * FP4, expert * c["n_shared_experts"] * FP8


def read_run(run_dir: str) -> dict:
    """What the run measured: the trace's spans (rank 0 of each instance, the proxy's, the client's)."""
    path = os.path.join(run_dir, "trace.json")
    if not os.path.exists(path):
        sys.exit(f"no {path}: run examples/seed_shape/run.sh {run_dir} first")
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    with open(os.path.join(run_dir, "model", "config.json")) as f:
        tiny = json.load(f)
    spans = defaultdict(list)
    for e in events:
        a = e["args"]
        if a.get("rank", 0) in (0, None):
            spans[a["step"]].append(e)
    role = lambda e: e["args"].get("instance", "").split(" ")[0]  # noqa: E731
    chunks = [e for e in spans[17] if role(e) == "prefill"]
    decode_steps = [e for e in spans[43] if role(e) == "decode"]
    verify = [e["args"] for e in spans[47]]
    drafts = sum(a["drafts"] for a in verify)
    accepted = sum(a["accepted"] for a in verify)
    prompt = chunks[0]["args"]["prompt_tokens"] if chunks else 0
    tp_run = next((e["args"]["tp"] for e in spans[2] if "tp" in e["args"]), 1)
    comm: dict = {}
    for step in COMM:
        for kind in ("prefill", "decode"):
            es = [e for e in spans[step] if role(e) == kind]
            if not es:
                continue
            rows = sum(c["args"]["tokens"] for c in chunks) if kind == "prefill" else \
                sum(e["args"]["tokens"] for e in decode_steps)
            layers = es[0]["args"].get("layers", 1) or 1
            n_steps = len(chunks) if kind == "prefill" else len(decode_steps)
            sizes = defaultdict(float)
            for e in es:
                for k, v in e["args"].items():
                    if k.endswith("_bytes"):
                        sizes[k.removesuffix("_bytes")] += v
            # in hidden-size units (float32 run) per row and layer: all-gathers and reduce-scatters
            # move whole-batch tensors; an all-to-all's bytes are what this rank sent of its own rows
            per = {k: v / max(1, (rows / tp_run if k == "alltoall" else rows) * layers * tiny["hidden_size"] * 4)
                   for k, v in sizes.items()}
            comm[(step, kind)] = dict(collectives_per_layer_step=sum(e["args"].get("collectives", 0) for e in es)
                                      / max(1, layers * n_steps), units=per)
    host = lambda steps, kind: sum(e["dur"] for s in steps for e in spans[s] if role(e) in (kind, "proxy", "")) / 1e3  # noqa: E731
    moved = [e["args"] for e in spans[55]]
    return dict(tiny=tiny, chunks=len(chunks), prompt=prompt, decode_steps=len(decode_steps), drafts=drafts,
                accepted=accepted, accepted_per_step=accepted / max(1, len(verify)), comm=comm,
                kv_bytes=sum(a["bytes"] for a in moved), host_prefill_ms=host(HOST_PREFILL, "prefill"),
                host_decode_ms=host(HOST_DECODE, "decode") / max(1, len(decode_steps)),
                k=max((a["drafts"] for a in verify), default=3))


def project(dev: dict, c: dict, run: dict, batch: int, acceptance: float | None) -> dict:
    """Projected ms of each model step, TTFT and TPOT, with each part's share."""
    k = run["k"]
    acc = acceptance if acceptance is not None else run["accepted"] / max(1, run["drafts"])
    tokens_per_step = 1 + k * acc  # expected tokens a verify step yields (uniform acceptance per position)
    lat = dev["latency_us"] / 1e3
    link = dev["link_gbps"] * 1e9 * 1e-3  # bytes per ms
    kinds = c["layer_types"]
    D, rows_chunk = c["hidden_size"], PROMPT / CHUNKS
    scale_a2a = c["num_experts_per_tok"] / run["tiny"]["num_experts_per_tok"]

    def comm_ms(kind: str, rows: float) -> dict[int, float]:
        """Each collective step's ms for a step of ``rows`` rows: latency per collective, plus the
        bytes through a rank's link (a ring's (n-1)/n of a whole-batch tensor; an all-to-all's
        own rows to the n-1 others, EP's scaled by V4-Flash's top-k over the tiny model's)."""
        out = {}
        for step in COMM:
            m = run["comm"].get((step, kind))
            if m is None:
                continue
            layers = 1 if step == 33 else len(kinds)
            wire = 0.0
            for coll, units in m["units"].items():
                if coll == "alltoall":
                    n = EP if step == 31 else TP
                    wire += units * (scale_a2a if step == 31 else 1.0) * rows / TP * D * BF16 * (n - 1) / n
                else:
                    wire += units * rows * D * BF16 * (TP - 1) / TP * (2 if coll == "allreduce" else 1)
            out[step] = m["collectives_per_layer_step"] * layers * lat + wire * layers / link
        return out

    # prefill: 4 chunks of 875 rows, each rank computing its 1/16 of the attention side and 1/32 of the experts
    pre = defaultdict(float)
    for i in range(CHUNKS):
        mid = (i + 0.5) * rows_chunk  # the chunk's rows' mean position
        for kind in kinds:
            lin, core, moe = layer_flops(c, kind, mid)
            pre[23] += rows_chunk * lin / TP / (dev["fp8_tflops"] * 1e9 * MFU)
            pre[27] += rows_chunk * core / TP / (dev["bf16_tflops"] * 1e9 * MFU)
            pre[30] += rows_chunk * moe / EP / (dev["fp8_tflops"] * 1e9 * MFU)
        for step, ms in comm_ms("prefill", rows_chunk).items():
            pre[step] += ms
    pre[32] = 2 * D * c["vocab_size"] / TP / (dev["bf16_tflops"] * 1e9 * MFU) * CHUNKS
    flash_bpt = run["flash_bytes_per_token"]
    kv_ms = PROMPT * flash_bpt * run["kv_overhead"] / (dev["pd_gbps"] * 1e6) + lat
    # decode: a verify step of batch x (k + 1) rows at context ~PROMPT; memory-bound on weights and KV reads
    rows = batch * (k + 1)
    attn_w, expert_w, shared_w = weight_bytes(c)
    hits = min(c["n_routed_experts"] / EP, rows * c["num_experts_per_tok"] / EP)  # local experts a step reads
    weights = len(kinds) * (attn_w / TP + hits * expert_w + shared_w / TP) + D * c["vocab_size"] * BF16 / TP
    kv_read = rows * len(kinds) * c["head_dim"] * (c["sliding_window"] + c["index_topk"]) / TP  # int8 keys
    flops = sum(rows * (lin / TP + core / TP + moe / EP) for kind in kinds
                for lin, core, moe in [layer_flops(c, kind, PROMPT)])
    dec = {30: weights / (dev["hbm_tbps"] * 1e9 * HBM_SHARE),
           27: kv_read / (dev["hbm_tbps"] * 1e9 * HBM_SHARE),
           23: flops / (dev["fp8_tflops"] * 1e9 * MFU)}
    dec.update(comm_ms("decode", rows))
    mtp_ms = k * (weights / len(kinds)) / (dev["hbm_tbps"] * 1e9 * HBM_SHARE)  # k MTP forwards of one layer
    dec[45] = mtp_ms
    device_step = sum(dec.values())
    ttft_dev = sum(pre.values()) + kv_ms + device_step
    ttft = run["host_prefill_ms"] + ttft_dev
    tpot_dev = device_step / tokens_per_step
    tpot = (device_step + run["host_decode_ms"]) / tokens_per_step
    compute = sum(v for s, v in pre.items() if s not in COMM)
    collectives = sum(v for s, v in pre.items() if s in COMM)
    return dict(prefill_steps=dict(pre), decode_steps=dec, kv_transfer_ms=kv_ms, acceptance=acc,
                tokens_per_step=tokens_per_step, ttft_ms=ttft, ttft_device_ms=ttft_dev, tpot_ms=tpot,
                tpot_device_ms=tpot_dev,
                ttft_share=dict(host=run["host_prefill_ms"] / ttft, compute=compute / ttft,
                                collectives=collectives / ttft, kv_transfer=kv_ms / ttft,
                                first_decode_step=device_step / ttft),
                tpot_share=dict(host=run["host_decode_ms"] / (device_step + run["host_decode_ms"]),
                                weights_and_kv=(dec[30] + dec[27] + dec[45]) / (device_step + run["host_decode_ms"]),
                                collectives=sum(v for s, v in dec.items() if s in COMM)
                                / (device_step + run["host_decode_ms"])))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", default="seed_shape_run", help="examples/seed_shape/run.sh's output directory")
    ap.add_argument("--decode-batch", type=int, default=1, help="requests per DP replica in a decode step")
    ap.add_argument("--acceptance", type=float, default=None,
                    help="per-draft acceptance to assume instead of the run's (a random tiny model's MTP is "
                         "built to draft, not trained)")
    args = ap.parse_args()
    if args.decode_batch < 1:
        ap.error("--decode-batch must be >= 1")
    if args.acceptance is not None and not 0 <= args.acceptance <= 1:
        ap.error("--acceptance must be in [0, 1]")
    run = read_run(args.run_dir)
    c = flash_config()
    tiny_bpt = explain_bytes_per_token(os.path.join(args.run_dir, "model"), "float32", "int8")
    run["kv_overhead"] = run["kv_bytes"] / max(1.0, run["prompt"] * tiny_bpt)
    run["flash_bytes_per_token"] = config_bytes_per_token({**c, "architectures": ["DeepseekV4ForCausalLM"]}, "int8")
    print(f"measured ({args.run_dir}/trace.json): prompt {run['prompt']} tokens in {run['chunks']} chunks, "
          f"{run['decode_steps']} decode steps, {run['accepted']}/{run['drafts']} drafts accepted, "
          f"KV moved {run['kv_bytes']:,} B ({run['kv_overhead']:.2f}x lane explain's int8 bytes for the prompt), "
          f"host {run['host_prefill_ms']:.1f} ms per request + {run['host_decode_ms']:.1f} ms per decode step")
    for (step, kind), m in sorted(run["comm"].items()):
        units = ", ".join(f"{k} {v:.2f}" for k, v in m["units"].items())
        print(f"  step {step} {COMM[step]:<20} {kind:<8} {m['collectives_per_layer_step']:.1f} collectives a layer "
              f"a step; x hidden per row and layer: {units}")
    print(f"derived: V4-Flash {len(c['layer_types'])} layers, hidden {c['hidden_size']}, int8 cache "
          f"{run['flash_bytes_per_token']:,.0f} B/token; TP{TP} x DP{DP}, EP{EP}; {PROMPT} tokens in {CHUNKS} "
          f"chunks; decode batch {args.decode_batch} x {run['k'] + 1} rows")
    print(f"assumed: MFU {MFU}, {HBM_SHARE:.0%} of HBM bandwidth, FP8 dense and FP4 routed-expert weights; devices:")
    results = {}
    for name, dev in DEVICES.items():
        print(f"  {name}: {dev['bf16_tflops']} / {dev['fp8_tflops']} TFLOP/s, {dev['hbm_tbps']} TB/s, link "
              f"{dev['link_gbps']} GB/s, {dev['latency_us']} us a collective, PD {dev['pd_gbps']} GB/s ({dev['note']})")
        results[name] = project(dev, c, run, args.decode_batch, args.acceptance)
    names = list(DEVICES)
    print(f"\n{'step':<28}" + "".join(f"{n + ' ms':>18}" for n in names) + "  source")
    from lane.tracing import STEPS

    for phase, key in (("prefill (4 chunks)", "prefill_steps"), ("decode (one verify step)", "decode_steps")):
        print(f"-- {phase}")
        for step in sorted(results[names[0]][key]):
            src = "measured structure + bytes, assumed link" if step in COMM else "derived FLOPs/bytes, assumed device"
            print(f"{step:>3} {STEPS[step].span:<24}" + "".join(f"{results[n][key][step]:>18.3f}" for n in names)
                  + f"  {src}")
    print(f"{'55 kv_transfer':<28}" + "".join(f"{results[n]['kv_transfer_ms']:>18.3f}" for n in names)
          + "  measured bytes ratio, assumed link")
    print()
    for n in names:
        r = results[n]
        share = lambda d: ", ".join(f"{k} {v:.0%}" for k, v in d.items())  # noqa: E731
        print(f"{n}: TTFT {r['ttft_ms']:.1f} ms ({share(r['ttft_share'])}; device only {r['ttft_device_ms']:.1f} ms)")
        print(f"{n}: TPOT {r['tpot_ms']:.2f} ms ({share(r['tpot_share'])}; device only {r['tpot_device_ms']:.2f} ms) "
              f"at {r['tokens_per_step']:.2f} tokens a step (acceptance {r['acceptance']:.2f})")
    print(json.dumps({"measured": {k: run[k] for k in ("prompt", "chunks", "decode_steps", "drafts", "accepted",
                                                        "kv_bytes", "host_prefill_ms", "host_decode_ms")},
                      **{n.replace(" ", "_").lower(): {k: round(results[n][k], 3) for k in (
                          "ttft_ms", "ttft_device_ms", "tpot_ms", "tpot_device_ms", "acceptance")} for n in names}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The seed's 57 steps (../shared/design/STEPS.md) as data: their lanes, phases and span
names, and ``Step``, the names call sites use (``Step.KV_ALLOCATE``, not 18)."""
from __future__ import annotations

import enum
from dataclasses import dataclass

LANES = ("client", "frontend", "engine", "scheduler", "kv", "worker", "runner", "model", "comm", "ops")
PHASES = ("start-up", "prefill", "decode loop", "background")


@dataclass(frozen=True)
class StepInfo:
    num: int
    phase: int
    lane: str
    span: str
    what: str


def _steps(phase: int, rows: str) -> list[StepInfo]:
    out = []
    for line in rows.strip().splitlines():
        num, lane, span, what = (x.strip() for x in line.split("|"))
        out.append(StepInfo(int(num), phase, lane, span, what))
    return out


STEPS: dict[int, StepInfo] = {s.num: s for s in [
    *_steps(0, """
        1 | ops | platform.init | device, dtype, threads
        2 | comm | dist.init | process groups up
        3 | model | registry.resolve | architecture -> implementation class
        4 | runner | loader.load_weights | weights read
        5 | comm | dist.bind_groups | model-parallel groups handed to the layers
        6 | worker | worker.warmup | warm-up run
        7 | model | eplb.initial_placement | initial expert placement
        8 | kv | kv.init_pool | KV block pool sized and allocated
        9 | engine | engine.ready | engine ready, health passes"""),
    *_steps(1, """
        10 | client | client.send | request leaves the client
        11 | frontend | api.parse | HTTP body parsed and validated
        12 | frontend | tokenizer.encode | chat template, text -> token ids
        13 | scheduler | dp.route | DP balancer picks the engine
        14 | engine | engine.add_request | request crosses IPC, joins the waiting queue
        15 | scheduler | scheduler.schedule | a scheduling round
        16 | kv | kv.prefix_lookup | prefix-cache lookup
        17 | scheduler | scheduler.chunk | prompt cut to the token budget
        18 | kv | kv.allocate | blocks allocated
        19 | engine | engine.dispatch | scheduler output to the worker
        20 | runner | runner.prepare_inputs | positions, slots, attention metadata
        21 | ops | ops.input_norm | embedding, RMSNorms
        22 | comm | comm.sp_scatter | sequence-parallel scatter
        23 | model | model.qkv_proj | Q/K/V projections and rotary
        24 | ops | ops.kv_write | K/V written to cache slots
        25 | model | model.indexer_topk | lightning indexer top-k
        26 | comm | comm.cp_gather | context-parallel KV gather
        27 | ops | ops.attention | attention
        28 | comm | comm.attn_reduce | output projection (+ all-reduce)
        29 | model | model.moe_route | MoE router
        30 | ops | ops.ffn | the FFN (dense MLP or MoE experts)
        31 | comm | comm.ffn_reduce | combine / all-reduce after the FFN
        32 | model | model.lm_head | final norm and logits
        33 | comm | comm.logits_gather | vocabulary shards gathered
        34 | runner | runner.sample | sampler picks the token
        35 | worker | worker.return | runner output back to the engine
        36 | scheduler | scheduler.update | request state advanced, full blocks cached
        37 | engine | engine.output | outputs sent back over IPC
        38 | frontend | tokenizer.decode | incremental detokenisation
        39 | frontend | api.stream | SSE chunk written
        40 | client | client.first_token | first token received (TTFT)"""),
    *_steps(2, """
        41 | scheduler | scheduler.check_stop | EOS, stop strings, max tokens
        42 | kv | kv.append_slot | slots for the new token
        43 | scheduler | scheduler.decode_batch | decode batch built
        44 | engine | engine.dispatch_decode | batch to the worker
        45 | model | model.mtp_draft | draft tokens proposed
        46 | model | model.verify | drafts scored
        47 | runner | runner.rejection_sample | accepted prefix kept
        48 | kv | kv.rollback | rejected drafts' slots given back
        49 | worker | worker.return_decode | outputs back to the engine
        50 | frontend | api.stream_delta | delta streamed
        51 | scheduler | scheduler.finish | request finished
        52 | kv | kv.free | blocks freed"""),
    *_steps(3, """
        53 | model | eplb.collect | expert heat gathered
        54 | comm | eplb.rebalance | experts re-placed
        55 | comm | kv_transfer | PD KV transfer
        56 | engine | metrics.publish | metrics updated / scraped
        57 | engine | health.probe | liveness probe"""),
]}

# Step.KV_ALLOCATE == 18, ...: each step named after its span ("kv.allocate")
Step = enum.IntEnum("Step", {s.span.upper().replace(".", "_"): n for n, s in STEPS.items()})

# steps an engine step performs under a different number for a decoding request
DECODE_STEP = {Step.SCHEDULER_SCHEDULE: Step.SCHEDULER_DECODE_BATCH, Step.KV_ALLOCATE: Step.KV_APPEND_SLOT,
               Step.ENGINE_DISPATCH: Step.ENGINE_DISPATCH_DECODE, Step.WORKER_RETURN: Step.WORKER_RETURN_DECODE,
               Step.SCHEDULER_UPDATE: Step.SCHEDULER_CHECK_STOP}


def skipped_steps(hf_config, tensor_parallel_size: int = 1, speculative: bool = False,
                  pd_disaggregation: bool = False, eplb: bool = False,
                  sequence_parallel: bool = False, dsa_cp: bool = False) -> dict[int, str]:
    """Steps this model and set-up never perform, and why (shown greyed in a trace)."""
    moe = any(getattr(hf_config, k, None) for k in ("n_routed_experts", "num_local_experts", "num_experts"))
    out: dict[int, str] = {}
    if not sequence_parallel:
        out[Step.COMM_SP_SCATTER] = "no sequence parallelism (--enable-sequence-parallel)"
    if not dsa_cp:
        out[Step.COMM_CP_GATHER] = "no context parallelism (--enable-dsa-cp)"
    if tensor_parallel_size == 1:
        single = "single rank (TP=1): no process groups"
        out.update({Step.DIST_INIT: single, Step.DIST_BIND_GROUPS: single,
                    Step.COMM_FFN_REDUCE: "no expert or tensor parallelism (TP=1)",
                    Step.COMM_LOGITS_GATHER: "vocabulary not sharded (TP=1)"})
    if not getattr(hf_config, "index_topk", None):
        out[Step.MODEL_INDEXER_TOPK] = "model has no index_topk (no lightning indexer)"
    if not moe:
        for step in (Step.EPLB_INITIAL_PLACEMENT, Step.MODEL_MOE_ROUTE, Step.EPLB_COLLECT, Step.EPLB_REBALANCE):
            out[step] = "dense model: no routed experts"
    elif not eplb:
        for step in (Step.EPLB_INITIAL_PLACEMENT, Step.EPLB_COLLECT, Step.EPLB_REBALANCE):
            out[step] = "EPLB off (--enable-eplb): experts stay where they loaded"
    if not speculative:
        for step in (Step.MODEL_MTP_DRAFT, Step.MODEL_VERIFY, Step.RUNNER_REJECTION_SAMPLE, Step.KV_ROLLBACK):
            out[step] = "speculative decoding off"
    if not pd_disaggregation:
        out[Step.KV_TRANSFER] = "PD disaggregation off"
    return out


def occasional_steps(eplb_config=None, kv_transfer_config=None) -> dict[int, str]:
    """Background steps that run every so often, and why a request's trace may hold none."""
    out: dict[int, str] = {
        Step.METRICS_PUBLISH: "no /metrics scrape while this request was in flight (a scrape is step 56)",
        Step.HEALTH_PROBE: "no /health probe while this request was in flight (lane proxy probes each "
                           "instance every --health-interval seconds)"}
    if kv_transfer_config is not None:
        out[Step.KV_TRANSFER] = (f"{kv_transfer_config.kv_connector} moved no KV for this request (a prompt of a "
                                 f"block or less, or none stored for it)")
    if eplb_config is not None:
        n = eplb_config.step_interval
        out[Step.EPLB_COLLECT] = f"EPLB collects expert heat every {n} engine steps; none while this request ran"
        out[Step.EPLB_REBALANCE] = f"EPLB rearranges experts every {n} engine steps; none while this request ran"
    return out


def coverage(spans: list[dict]) -> tuple[list[int], dict[int, str]]:
    """A trace's spans (as dicts) -> (the steps it recorded, {every other step: why not})."""
    ran = sorted({s["step"] for s in spans if not s.get("skipped")})
    why = {s["step"]: s["skipped"] for s in spans if s.get("skipped")}
    return ran, {n: why.get(n, "no span recorded and no reason given") for n in STEPS if n not in ran}


def coverage_line(spans: list[dict]) -> str:
    """"57/57 steps recorded", or the count and each missing step with its reason."""
    ran, missing = coverage(spans)
    line = f"{len(ran)}/{len(STEPS)} steps recorded"
    return line + "".join(f"\n  missing {n} {STEPS[n].span}: {why}" for n, why in missing.items())

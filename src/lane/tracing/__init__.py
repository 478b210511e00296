"""Tracing (seed step catalogue, ../shared/design/STEPS.md): the 57 steps as data, and a
span recorder each process uses.

Cheap when on, free when off: every call site tests ``tracer.enabled`` (or gets the
no-op ``mark``) before doing any work. Times are time.monotonic() seconds:
CLOCK_MONOTONIC is one clock for every process on a machine, so spans recorded by
the API server and the engine cores lie on one axis without offsets.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

LANES = ("client", "frontend", "engine", "scheduler", "kv", "worker", "runner", "model", "comm", "ops")
PHASES = ("start-up", "prefill", "decode loop", "background")


@dataclass(frozen=True)
class Step:
    num: int
    phase: int
    lane: str
    span: str
    what: str


def _steps(phase: int, rows: str) -> list[Step]:
    out = []
    for line in rows.strip().splitlines():
        num, lane, span, what = (x.strip() for x in line.split("|"))
        out.append(Step(int(num), phase, lane, span, what))
    return out


STEPS: dict[int, Step] = {s.num: s for s in [
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

# per-layer steps (21-31): one span per step per forward, with the summed time
LAYER_STEPS = (21, 23, 24, 27, 28, 30)
# steps an engine step performs under a different number for a decoding request
DECODE_STEP = {15: 43, 18: 42, 19: 44, 35: 49, 36: 41}


@dataclass
class Span:
    step: int
    start: float  # time.monotonic() seconds
    dur: float = 0.0
    request_ids: list[str] | None = None  # None: not tied to requests (start-up, background)
    attrs: dict = field(default_factory=dict)
    pid: int = 0
    skipped: str | None = None  # reason, for a step that does not apply


class Tracer:
    """This process's span buffer."""

    def __init__(self) -> None:
        self.enabled = False
        self.layer_detail = False
        self.spans: list[Span] = []
        self.pid = os.getpid()
        self.sink = None  # a callable taking each span at once (the API server's TraceStore)

    def enable(self, layer_detail: bool = False) -> None:
        self.enabled, self.layer_detail, self.pid = True, layer_detail, os.getpid()

    def record(self, step: int, start: float, end: float, request_ids: list[str] | None = None,
               **attrs) -> Span:
        span = Span(step, start, max(end - start, 0.0), request_ids, attrs, self.pid)
        if self.sink is not None:
            self.sink(span)
        else:
            self.spans.append(span)
        return span

    def skip(self, step: int, reason: str) -> None:
        self.spans.append(Span(step, time.monotonic(), 0.0, None, {}, self.pid, reason))

    def drain(self) -> list[Span]:
        out, self.spans = self.spans, []
        return out


tracer = Tracer()


class ForwardProfile:
    """Per-layer step times of one forward, summed over layers (steps 21-32). Model code
    calls ``mark(step)`` after each piece: the time since the previous mark is that step's."""

    def __init__(self) -> None:
        self.acc: dict[int, float] = {}
        self.attrs: dict[int, dict[str, set]] = {}  # step -> attribute -> the values layers gave
        self.detail: list[tuple[int, float, float, dict]] = []  # (step, start, end, attrs) with --trace-layers
        self.start = self.last = 0.0

    def begin(self) -> None:
        self.acc = {}
        self.attrs = {}
        self.detail = []
        self.start = self.last = time.monotonic()

    def mark(self, step: int, **attrs) -> None:
        """``attrs`` describe this layer's piece (e.g. its layer type): per-layer spans
        carry them; summed spans list every value seen."""
        now = time.monotonic()
        self.acc[step] = self.acc.get(step, 0.0) + (now - self.last)
        for k, v in attrs.items():
            self.attrs.setdefault(step, {}).setdefault(k, set()).add(v)
        if tracer.layer_detail:
            self.detail.append((step, self.last, now, attrs))
        self.last = now

    def emit(self, request_ids: list[str], num_layers: int, step_attrs: dict[int, dict] | None = None) -> None:
        """One span per step, laid end to end from the forward's start in step order
        (their real times interleave layer by layer; the sums are what they cost)."""
        step_attrs = step_attrs or {}
        if self.detail:
            for step, s, e, attrs in self.detail:
                tracer.record(step, s, e, request_ids, placement="per-layer", **step_attrs.get(step, {}), **attrs)
            return
        t = self.start
        for step in sorted(self.acc):
            dur = self.acc[step]
            seen = {k: ",".join(sorted(map(str, v))) for k, v in self.attrs.get(step, {}).items()}
            tracer.record(step, t, t + dur, request_ids, layers=1 if step in (32,) else num_layers,
                          placement="summed over layers", **{**step_attrs.get(step, {}), **seen})
            t += dur


_profile = ForwardProfile()


def _noop(step: int, **attrs) -> None:
    pass


def forward_mark():
    """``mark`` for model code: the profile's when tracing, else a no-op."""
    return _profile.mark if tracer.enabled else _noop


def forward_profile() -> ForwardProfile | None:
    return _profile if tracer.enabled else None


def skipped_steps(hf_config, tensor_parallel_size: int = 1, speculative: bool = False,
                  pd_disaggregation: bool = False) -> dict[int, str]:
    """Steps this model and set-up never perform, and why (shown greyed in a trace)."""
    moe = any(getattr(hf_config, k, None) for k in ("n_routed_experts", "num_local_experts", "num_experts"))
    out: dict[int, str] = {}
    if tensor_parallel_size == 1:
        single = "single rank (TP=1): no process groups"
        out.update({2: single, 5: single, 22: "no sequence parallelism (TP=1)",
                    26: "no context parallelism", 31: "no expert or tensor parallelism (TP=1)",
                    33: "vocabulary not sharded (TP=1)"})
    if not getattr(hf_config, "index_topk", None):
        out[25] = "model has no index_topk (no lightning indexer)"
    if not moe:
        for step in (7, 29, 53, 54):
            out[step] = "dense model: no routed experts"
    if not speculative:
        for step in (45, 46, 47, 48):
            out[step] = "speculative decoding off"
    if not pd_disaggregation:
        out[55] = "PD disaggregation off"
    return out


class TraceStore:
    """The frontend's spans of the last ``max_requests`` requests, plus the start-up
    spans every trace carries (lane serve --trace)."""

    def __init__(self, max_requests: int = 100) -> None:
        from collections import OrderedDict, deque

        self.max_requests = max_requests
        self.startup: list[Span] = []
        self.skipped: dict[int, str] = {}
        self.requests: OrderedDict[str, list[Span]] = OrderedDict()
        self.background: deque[Span] = deque(maxlen=512)

    @staticmethod
    def parent_id(request_id: str) -> str:
        """An n > 1 sample's engine id is "<i>_<parent id>"."""
        head, sep, rest = request_id.partition("_")
        return rest if sep and head.isdigit() else request_id

    def add(self, span: Span) -> None:
        if span.request_ids is None:
            (self.startup if span.step <= 9 else self.background).append(span)
            return
        for rid in {self.parent_id(r) for r in span.request_ids}:
            spans = self.requests.get(rid)
            if spans is None:
                spans = self.requests[rid] = []
                while len(self.requests) > self.max_requests:
                    self.requests.popitem(last=False)
            spans.append(span)

    def get(self, request_id: str) -> dict | None:
        spans = self.requests.get(request_id)
        if spans is None:
            return None
        t0 = min(s.start for s in spans)
        t1 = max(s.start + s.dur for s in spans)
        background = [s for s in self.background if t0 <= s.start <= t1]
        skipped = [Span(step, t0, 0.0, None, {}, 0, reason) for step, reason in sorted(self.skipped.items())]
        return {"request_id": request_id, "spans": [span_dict(s) for s in
                                                    sorted(self.startup + spans + background, key=_order)]
                + [span_dict(s) for s in skipped]}


def _order(s: Span) -> tuple:
    return (s.start, s.step)


def span_dict(s: Span) -> dict:
    step = STEPS[s.step]
    d = {"step": s.step, "name": step.span, "lane": step.lane, "phase": step.phase, "start": s.start,
         "dur": s.dur, "pid": s.pid, "attrs": s.attrs}
    if s.request_ids is not None:
        d["request_ids"] = s.request_ids
    if s.skipped is not None:
        d["skipped"] = s.skipped
    return d

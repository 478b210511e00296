"""What the metrics are made of (seed step 56), as vLLM v1 splits it:
SchedulerStats come from the engine core with every output batch; IterationStats
and per-request timings are gathered in the frontend as outputs arrive.

All timestamps are time.monotonic(): CLOCK_MONOTONIC is one clock for every
process on the machine, so engine and frontend times can be subtracted.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use (cached-but-free blocks count as free)
    # cumulative since start; the frontend turns them into counter increments
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_preemptions: int = 0
    spec_decoding: "SpecDecodingStats | None" = None  # with speculative decoding
    eplb: "EplbStats | None" = None  # with --enable-eplb
    prompt_tokens_computed: int = 0  # cumulative: prompt tokens this engine computed (no hit, no transfer)
    kv_transfer: "KVTransferStats | None" = None  # with --kv-transfer-config
    dp: "DPStats | None" = None  # data-parallel attention: the replicas' lock-step


@dataclass
class DPStats:
    """The replicas' lock-step, as one replica sees it (engine/dp_coordinator.py)."""
    imbalance: float = 1.0  # most tokens a replica scheduled over the mean, the last 64 steps with work
    dummy_batches: int = 0  # steps this replica ran a dummy batch so the others' collectives met
    frozen_steps: int = 0  # steps nobody admitted because a replica was at its cap
    steps: int = 0  # steps with work somewhere
    running: list[int] = field(default_factory=list)  # every replica's running requests


@dataclass
class KVTransferStats:
    """PD disaggregation's transfers on this engine (cumulative, rank 0's view)."""
    bytes: int = 0  # KV bytes sent and received
    transfers: int = 0  # steps that moved KV
    recent_seconds: list[float] = field(default_factory=list)  # the last steps' transfer times (at most 64)
    failures: int = 0  # requests whose KV could not arrive
    expired: int = 0  # requests whose KV nobody pulled before the timeout

    def add(self, out) -> None:
        """One step's KVConnectorOutput."""
        self.bytes += out.bytes_sent + out.bytes_received
        if out.bytes_sent or out.bytes_received:
            self.transfers += 1
            self.recent_seconds = self.recent_seconds[-63:] + [out.seconds]
        self.failures += len(out.failed)

    def new_seconds(self, last: "KVTransferStats | None") -> list[float]:
        """The transfer times recorded since ``last`` (those still among the recent ones)."""
        n = self.transfers - (last.transfers if last else 0)
        return self.recent_seconds[-n:] if n > 0 else []

    def copy(self) -> "KVTransferStats":
        return KVTransferStats(self.bytes, self.transfers, list(self.recent_seconds), self.failures, self.expired)


@dataclass
class EplbStats:
    """Expert load balancing, from the workers (rank 0's view; every rank keeps the same maps)."""
    # mean over max tokens per EP rank, worst and median MoE layer, over the last heat window
    balancedness_min: float = 1.0
    balancedness_p50: float = 1.0
    rebalance_events: int = 0  # rearrangements decided (cumulative)
    rebalancing: bool = False  # weights are being moved (async: over several steps)
    rearrangement_seconds: list[float] = field(default_factory=list)  # each finished rearrangement's time
    moved_bytes: int = 0  # expert weight bytes sent between ranks (cumulative)


@dataclass
class SpecDecodingStats:
    """Cumulative, like the prefix-cache counts (vLLM's names)."""
    num_spec_tokens: int  # k: drafts a step proposes at most
    num_drafts: int = 0  # verifications of one request's drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0  # drafts accepted (the target's own token not counted)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [k]: accepted at draft position i

    def __post_init__(self) -> None:
        self.num_accepted_tokens_per_pos = self.num_accepted_tokens_per_pos or [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    def since(self, then: "SpecDecodingStats | None") -> "SpecDecodingStats":
        """What was counted after ``then`` (None: since the start)."""
        if then is None:
            return self.copy()
        return SpecDecodingStats(self.num_spec_tokens, self.num_drafts - then.num_drafts,
                                 self.num_draft_tokens - then.num_draft_tokens,
                                 self.num_accepted_tokens - then.num_accepted_tokens,
                                 [a - b for a, b in zip(self.num_accepted_tokens_per_pos,
                                                        then.num_accepted_tokens_per_pos)])

    def copy(self) -> "SpecDecodingStats":
        return SpecDecodingStats(self.num_spec_tokens, self.num_drafts, self.num_draft_tokens,
                                 self.num_accepted_tokens, list(self.num_accepted_tokens_per_pos))


@dataclass
class FinishedRequestStats:
    finish_reason: str
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int
    queued_time: float
    prefill_time: float
    decode_time: float
    inference_time: float
    time_to_first_token: float

    def timing_ms(self) -> dict[str, float]:
        """Per-request timing, as vLLM's RequestOutput.metrics has it, in milliseconds."""
        n = self.num_generation_tokens
        mean_itl = self.decode_time / (n - 1) if n > 1 else 0.0
        return {k: round(v * 1000, 3) for k, v in (
            ("queue_ms", self.queued_time), ("prefill_ms", self.prefill_time), ("decode_ms", self.decode_time),
            ("ttft_ms", self.time_to_first_token), ("e2e_ms", self.e2e_latency), ("mean_itl_ms", mean_itl))}


@dataclass
class IterationStats:
    """One batch of outputs received from an engine."""
    num_prompt_tokens: int = 0  # of requests that got their first token here
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


@dataclass
class RequestStateStats:
    """Timings of one engine request, kept by the frontend."""
    arrival_time: float
    queued_ts: float = 0.0  # engine: request entered the waiting queue
    scheduled_ts: float = 0.0  # engine: first scheduled
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    num_generation_tokens: int = 0
    finished: FinishedRequestStats | None = None  # set by finish()

    def update(self, now: float, num_new: int, stats: IterationStats, num_prompt_tokens: int) -> None:
        if num_new == 0:
            return
        if self.num_generation_tokens == 0:
            self.first_token_ts = now
            stats.time_to_first_tokens.append(now - self.arrival_time)
            stats.num_prompt_tokens += num_prompt_tokens
        else:
            stats.inter_token_latencies.append(now - self.last_token_ts)
        self.last_token_ts = now
        self.num_generation_tokens += num_new
        stats.num_generation_tokens += num_new

    def finish(self, now: float, reason: str, num_prompt_tokens: int) -> FinishedRequestStats:
        scheduled = self.scheduled_ts or self.first_token_ts or now
        queued = self.queued_ts or self.arrival_time
        first = self.first_token_ts or now
        last = self.last_token_ts or now
        self.finished = FinishedRequestStats(
            reason, max(now - self.arrival_time, 0.0), num_prompt_tokens, self.num_generation_tokens,
            queued_time=max(scheduled - queued, 0.0), prefill_time=max(first - scheduled, 0.0),
            decode_time=max(last - first, 0.0), inference_time=max(last - scheduled, 0.0),
            time_to_first_token=max(first - self.arrival_time, 0.0))
        return self.finished

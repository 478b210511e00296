"""Continuous-batching scheduler with chunked prefill (seed steps 15, 17, 41, 43, 51).

There are no prefill and decode phases: each step gives every request enough
tokens for its computed count to catch up with its token count (prompt +
output), within a token budget. Running requests go first, then waiting ones.
A long prompt simply gets a budget-sized slice per step (chunked prefill), and
its slices share a step with other requests' decodes. When blocks run out the
newest running request is preempted and later recomputed.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from lane.config import CacheConfig, SchedulerConfig
from lane.core.kv_cache_manager import KVCacheManager
from lane.core.request import Request, RequestStatus
from lane.engine.messages import EngineCoreOutput
from lane.metrics.stats import SchedulerStats
from lane.tracing import Step, tracer


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed for it this step
    block_ids: list[int]
    state_slot: int = 0  # its running-state slot (models with compressed attention), 0 = none
    window_block_ids: list[int] | None = None  # the sliding-window group's table (null block = released)
    fresh: bool = False  # first chunk since (re)admission: the running state starts anew here

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last token (so a token is sampled)."""
        r = self.request
        return r.num_computed_tokens + self.num_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    num_prefix_hit_tokens: int = 0

    @property
    def total_num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SamplerResult:
    token_id: int
    logprobs: tuple | None = None  # (logprob, rank, [(token_id, logprob), ...])


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 eos_token_ids: list[int] | None = None) -> None:
        self.config = scheduler_config
        self.max_model_len = scheduler_config.max_model_len
        self.kv = KVCacheManager(cache_config.num_blocks, cache_config.block_size,
                                 cache_config.enable_prefix_caching, cache_config.num_state_slots,
                                 cache_config.num_window_blocks, cache_config.sliding_window)
        self.eos_token_ids = set(eos_token_ids or [])
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queue ---------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.kv.usage,
                              self.kv.stats.queries, self.kv.stats.hits, self.num_preemptions)

    # -- step 15: one scheduling round ----------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        preempted_now = False

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)  # step 17: chunk
            if n <= 0:
                i += 1
                continue
            t_alloc = time.monotonic() if tracer.enabled else 0.0
            while self.kv.allocate_slots(req, n) is None:  # step 18 / 42
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                preempted_now = True
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break
            out.scheduled.append(self._scheduled(req, n))
            if tracer.enabled:
                self._trace_running(req, n, t_alloc)
            budget -= n
            i += 1

        # no admissions in a step that had to preempt
        while (not preempted_now and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            hit_blocks, n_hit = None, 0
            t_lookup = time.monotonic() if tracer.enabled else 0.0
            if req.num_computed_tokens == 0:
                hit_blocks, n_hit = self.kv.get_computed_blocks(req)  # step 16
            n = min(req.num_tokens - req.num_computed_tokens - n_hit, budget)
            t_alloc = time.monotonic() if tracer.enabled else 0.0
            if self.kv.allocate_slots(req, n, hit_blocks) is None:
                break
            if tracer.enabled:
                rid = [req.request_id]
                tracer.record(Step.KV_PREFIX_LOOKUP, t_lookup, t_alloc, rid, hit_tokens=n_hit,
                              hit_blocks=hit_blocks.num_blocks if hit_blocks else 0,
                              prompt_tokens=req.num_prompt_tokens, caching=self.kv.enable_caching)
                tracer.record(Step.KV_ALLOCATE, t_alloc, time.monotonic(), rid, blocks=len(self.kv.get_block_ids(req)))
                tracer.record(Step.SCHEDULER_CHUNK, t_alloc, t_alloc, rid, chunk=0, tokens=n,
                              from_token=req.num_computed_tokens + n_hit, prompt_tokens=req.num_prompt_tokens,
                              budget=self.config.max_num_batched_tokens)
            self.waiting.popleft()
            if self.kv.enable_caching:
                self.kv.record_prefix_lookup(req.num_tokens, n_hit)
            out.num_prefix_hit_tokens += n_hit
            req.num_computed_tokens += n_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = n_hit
            req.status = RequestStatus.RUNNING
            if not req.scheduled_ts:
                req.scheduled_ts = time.monotonic()
            self.running.append(req)
            out.scheduled.append(self._scheduled(req, n, fresh=True))
            budget -= n
        return out

    def _scheduled(self, req: Request, n: int, fresh: bool = False) -> ScheduledRequest:
        return ScheduledRequest(req, n, self.kv.get_block_ids(req), self.kv.state_slot(req),
                                self.kv.get_window_block_ids(req), fresh)

    def _trace_running(self, req: Request, n: int, t_alloc: float) -> None:
        """Spans of a running request's slice: a later prefill chunk (17, 18) or a decode (42)."""
        now = time.monotonic()
        rid = [req.request_id]
        blocks = len(self.kv.get_block_ids(req))
        if req.num_output_tokens and n == 1:
            tracer.record(Step.KV_APPEND_SLOT, t_alloc, now, rid, blocks=blocks)
        else:
            req.num_chunks += 1
            tracer.record(Step.SCHEDULER_CHUNK, t_alloc, t_alloc, rid, chunk=req.num_chunks, tokens=n,
                          from_token=req.num_computed_tokens, prompt_tokens=req.num_prompt_tokens,
                          budget=self.config.max_num_batched_tokens)
            tracer.record(Step.KV_ALLOCATE, t_alloc, now, rid, blocks=blocks)

    def _preempt(self, req: Request) -> None:
        """Recompute-style preemption: drop its blocks, put it back at the front."""
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- step 36 / 41: apply the model's output --------------------------------
    def update_from_output(self, sched: SchedulerOutput,
                           sampled: dict[str, SamplerResult]) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        for s in sched.scheduled:
            req = s.request
            if req.status != RequestStatus.RUNNING:
                continue  # aborted meanwhile
            samples = s.samples
            req.num_computed_tokens += s.num_tokens
            self.kv.cache_full_blocks(req)
            if not samples:
                continue  # a prefill chunk that is not the last one
            result = sampled[req.request_id]
            req.append_output_token(result.token_id)
            status = self._check_stop(req, result.token_id)
            out = EngineCoreOutput(req.request_id, [result.token_id],
                                   [result.logprobs] if result.logprobs is not None else None,
                                   num_cached_tokens=max(req.num_cached_tokens, 0))
            if req.num_output_tokens == 1:
                out.queued_ts, out.scheduled_ts = req.arrival_time, req.scheduled_ts
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
                out.finish_reason = status.finish_reason
                out.stop_reason = req.stop_reason
            outputs.append(out)
        return outputs

    def _check_stop(self, req: Request, token_id: int) -> RequestStatus | None:
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in sp.stop_token_ids:
                req.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Stop requests from outside (a stop string seen by the detokenizer, an abort)."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.status.finished:
                continue
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        t0 = time.monotonic() if tracer.enabled else 0.0
        req.status = status
        blocks = len(self.kv.req_blocks.get(req.request_id, ())) if tracer.enabled else 0
        self.kv.free(req)  # step 52
        del self.requests[req.request_id]
        if tracer.enabled:
            now = time.monotonic()
            tracer.record(Step.SCHEDULER_FINISH, t0, t0, [req.request_id], reason=status.finish_reason,
                          output_tokens=req.num_output_tokens)
            tracer.record(Step.KV_FREE, t0, now, [req.request_id], blocks=blocks,
                          cached=self.kv.enable_caching)

"""Continuous-batching scheduler with chunked prefill (seed steps 15-18, 36, 41-43, 51-52).

There are no prefill and decode phases: each step gives every request enough
tokens for its computed count to catch up with its token count (prompt +
output), within a token budget. A long prompt simply gets a budget-sized slice
per step (chunked prefill), and its slices share a step with other requests'
decodes. When blocks run out the newest running request is preempted and later
recomputed.

Who goes first (``SchedulerConfig.policy``): ``decode-first`` (vLLM's order)
gives running requests their tokens, then waiting ones what is left;
``prefill-first`` gives the budget to prompts first (the ones already being
prefilled, then waiting ones) and running requests' decodes the rest, so a
burst of arrivals gets its first tokens in as few steps as the budget allows
while the decodes wait those steps (see benchmarks/scheduler_budget.py).

What it decides leaves as a ``SchedulerOutput`` (data); the runner's result comes
back as a ``ModelRunnerOutput``. With ``log_events`` it records each request's steps as
``RequestEvent``s, which the engine turns into trace spans.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from lane.config import SchedulerConfig, SpeculativeConfig
from lane.core.kv_cache_coordinator import KVCacheBlocks
from lane.core.kv_cache_manager import KVCacheManager
from lane.core.request import Request, RequestStatus
from lane.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from lane.engine.messages import EngineCoreOutput
from lane.kv_cache_interface import KVCacheConfig
from lane.kv_transfer.base import KVConnectorBase
from lane.metrics.stats import KVTransferStats, SchedulerStats, SpecDecodingStats
from lane.outputs import ModelRunnerOutput
from lane.tracing.steps import Step

if TYPE_CHECKING:
    from lane.structured_output.manager import StructuredOutputManager


@dataclass
class RequestEvent:
    step: Step
    start: float  # time.monotonic()
    end: float
    request_id: str
    attrs: dict = field(default_factory=dict)


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, kv_cache_config: KVCacheConfig,
                 enable_prefix_caching: bool = True, eos_token_ids: list[int] | None = None,
                 log_events: bool = False, speculative_config: SpeculativeConfig | None = None,
                 structured_output: Callable[[], StructuredOutputManager] | None = None,
                 kv_connector: KVConnectorBase | None = None) -> None:
        self.config = scheduler_config
        # structured outputs: made on the first request that asks (the tokenizer, xgrammar)
        self._make_structured_output = structured_output
        self.structured_output: StructuredOutputManager | None = None
        # speculative decoding: drafts come back from the runner, are scheduled like any other
        # tokens, and what the target rejects is rolled back (steps 45-48)
        self.num_lookahead = speculative_config.num_lookahead_slots if speculative_config else 0
        self.spec_stats = SpecDecodingStats(speculative_config.num_speculative_tokens) if speculative_config else None
        self.max_model_len = scheduler_config.max_model_len
        self.kv = KVCacheManager(kv_cache_config, enable_prefix_caching)
        self.eos_token_ids = set(eos_token_ids or [])
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.finished_req_ids: list[str] = []  # not yet told to the workers
        self.events: list[RequestEvent] | None = [] if log_events else None
        # PD disaggregation (kv_transfer/): prompt tokens other engines computed come in as blocks
        self.connector = kv_connector
        self.kv_transfer_stats = KVTransferStats() if kv_connector is not None else None
        if kv_connector is not None:
            kv_connector.bind_block_ids(self.kv.get_block_ids)
        self.num_prompt_tokens_computed = 0  # here, not found in the prefix cache nor transferred
        self.delayed_free: dict[str, Request] = {}  # finished, their blocks kept for another engine to pull
        # admitted, their blocks filling from another engine: request id -> (request, tokens arriving)
        self.waiting_for_remote: dict[str, tuple[Request, int]] = {}
        # data-parallel balance (the seed's BalanceScheduler): set for a step while another replica
        # in lock-step is at its cap, so this one admits nobody either
        self.admission_frozen = False

    # -- queue ---------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if (so := req.sampling_params.structured_outputs) is not None:
            if self.structured_output is None:
                if self._make_structured_output is None:
                    raise ValueError("structured outputs are not available in this engine")
                self.structured_output = self._make_structured_output()
            self.structured_output.submit(req.request_id, so)  # compiles while others decode
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.kv.usage,
                              self.kv.stats.queries, self.kv.stats.hits, self.num_preemptions,
                              self.spec_stats.copy() if self.spec_stats else None,
                              prompt_tokens_computed=self.num_prompt_tokens_computed,
                              kv_transfer=self.kv_transfer_stats.copy() if self.kv_transfer_stats else None)

    def drain_events(self) -> list[RequestEvent]:
        out, self.events = self.events or [], [] if self.events is not None else None
        return out

    def _event(self, step: Step, start: float, end: float, req: Request, **attrs) -> None:
        self.events.append(RequestEvent(step, start, end, req.request_id, attrs))

    # -- step 15: one scheduling round ----------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.delayed_free:
            self._free_expired()
        out = SchedulerOutput()
        cached = out.scheduled_cached_reqs
        budget = self.config.max_num_batched_tokens
        log = self.events is not None
        preempted_now = False

        # prefill-first: decodes wait while a waiting request can be admitted this step
        defer = (self.config.policy == "prefill-first" and bool(self.waiting) and not self.admission_frozen
                 and len(self.running) < self.config.max_num_seqs)
        deferred: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if defer and req.num_output_tokens:  # its prompt is done: a decode, after the prompts
                deferred.append(req)
                i += 1
                continue
            pending = req.num_tokens - req.num_computed_tokens
            n = min(pending + len(req.spec_token_ids), budget)  # step 17: chunk (drafts count too)
            if n <= 0:
                i += 1
                continue
            drafts = req.spec_token_ids[:max(n - pending, 0)]  # those the budget leaves room for
            if drafts and req.sampling_params.structured_outputs is not None:
                drafts, n = [], pending  # no grammar bitmasks for draft positions (yet)
            t_alloc = time.monotonic() if log else 0.0
            lookahead = self._lookahead(req.num_computed_tokens + n)
            while (new_blocks := self.kv.allocate_slots(req, n, None, lookahead)) is None:  # 18 / 42
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_req_ids.append(victim.request_id)
                preempted_now = True
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break
            self._add_cached(cached, req, new_blocks, resumed=False)
            out.num_scheduled_tokens[req.request_id] = n
            self._count_prompt_tokens(req, n)
            if drafts:
                out.scheduled_spec_decode_tokens[req.request_id] = drafts
            if log:
                self._log_running(req, n - len(drafts), t_alloc)
            budget -= n
            i += 1

        # no admissions in a step that had to preempt
        compiling: list[Request] = []  # waiting for their grammar: the others go ahead
        while (not preempted_now and self.waiting and budget > 0 and not self.admission_frozen
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            if self.structured_output is not None and not self.structured_output.ready(req.request_id):
                compiling.append(self.waiting.popleft())
                continue
            hit, n_hit, n_ext, load_async = None, 0, 0, False
            t_lookup = time.monotonic() if log else 0.0
            if req.num_computed_tokens == 0:
                hit, n_hit = self.kv.get_computed_blocks(req)  # step 16
                if self.connector is not None:  # tokens another engine computed (step 55)
                    n_ext, load_async = self.connector.get_num_new_matched_tokens(req, n_hit)
                    n_ext = n_ext or 0
            n = min(req.num_tokens - req.num_computed_tokens - n_hit - n_ext, budget)
            t_alloc = time.monotonic() if log else 0.0
            if load_async and n_ext:  # blocks for what arrives; it computes nothing until then
                n = 0
            new_blocks = self.kv.allocate_slots(req, n_ext + n, hit,
                                                self._lookahead(req.num_computed_tokens + n_hit + n_ext + n),
                                                num_skipped_tokens=req.num_computed_tokens + n_hit + n_ext)
            if new_blocks is None:
                break
            if self.connector is not None:
                self.connector.update_state_after_alloc(req, self.kv.get_block_ids(req.request_id), n_ext)
            if load_async and n_ext:
                self.waiting.popleft()
                if self.kv.enable_caching:
                    self.kv.record_prefix_lookup(req.num_tokens, n_hit)
                req.num_computed_tokens += n_hit
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                self.waiting_for_remote[req.request_id] = (req, n_ext)
                continue
            if log:
                self._event(Step.KV_PREFIX_LOOKUP, t_lookup, t_alloc, req, hit_tokens=n_hit,
                            hit_blocks=hit.num_blocks if hit else 0, prompt_tokens=req.num_prompt_tokens,
                            caching=self.kv.enable_caching)
                self._event(Step.KV_ALLOCATE, t_alloc, time.monotonic(), req,
                            blocks=self.kv.num_blocks_held(req.request_id))
                self._event(Step.SCHEDULER_CHUNK, t_alloc, t_alloc, req, chunk=0, tokens=n,
                            from_token=req.num_computed_tokens + n_hit, prompt_tokens=req.num_prompt_tokens,
                            budget=self.config.max_num_batched_tokens)
            self.waiting.popleft()
            if self.kv.enable_caching:
                self.kv.record_prefix_lookup(req.num_tokens, n_hit)
            req.num_computed_tokens += n_hit + n_ext
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = n_hit
            resumed = req.status == RequestStatus.PREEMPTED
            req.status = RequestStatus.RUNNING
            if not req.scheduled_ts:
                req.scheduled_ts = time.monotonic()
            self.running.append(req)
            if resumed:  # the workers still hold it: all its blocks are new
                self._add_cached(cached, req, None, resumed=True)
            else:
                out.scheduled_new_reqs.append(NewRequestData(
                    req.request_id, req.prompt_token_ids, req.sampling_params,
                    self.kv.get_block_ids(req.request_id), req.num_computed_tokens, req.kv_state_arrived))
            out.num_scheduled_tokens[req.request_id] = n
            self._count_prompt_tokens(req, n)
            budget -= n
        self.waiting.extendleft(reversed(compiling))
        if deferred:
            self._schedule_deferred(out, deferred, budget)
            if not out.num_scheduled_tokens and not preempted_now:
                # nothing could go (no blocks for a prompt, nor for a decode without preempting):
                # this step is decode-first, whose running loop preempts to make room
                return self._decode_first_fallback()
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        if self.structured_output is not None:
            self._grammar_bitmask(out)
        if not out.is_empty:  # else they wait for a step the workers run
            out.finished_req_ids, self.finished_req_ids = self.finished_req_ids, []
            if self.connector is not None:
                out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    def has_connector_work(self) -> bool:
        """Transfers under way: blocks kept for another engine, requests waiting for theirs."""
        return self.connector is not None and bool(self.delayed_free or self.waiting_for_remote
                                                   or self.connector.has_pending_meta())

    def connector_step(self) -> SchedulerOutput:
        """A step with no tokens to compute that carries the connector's work to the workers
        (what they are to serve or stop serving) and brings back what they finished."""
        self._free_expired()
        out = SchedulerOutput()
        out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    def _free_expired(self) -> None:
        """Blocks kept for another engine that nobody pulled in time go back to the pool."""
        for rid in self.connector.take_expired():
            if (req := self.delayed_free.pop(rid, None)) is not None:
                self.kv.free(req)
                self.kv_transfer_stats.expired += 1

    def _update_transfers(self, kv_out) -> None:
        """What the workers' transfers finished: blocks another engine pulled are freed; requests
        whose KV arrived go back to the front of the queue to compute the rest (or, if it could not
        arrive, their whole prompt)."""
        self.connector.update_connector_output(kv_out)
        self.kv_transfer_stats.add(kv_out)
        for rid in kv_out.finished_sending:
            if (req := self.delayed_free.pop(rid, None)) is not None:
                self.kv.free(req)
        for rid in kv_out.finished_recving:
            entry = self.waiting_for_remote.pop(rid, None)
            if entry is None:
                continue
            req, n_ext = entry
            if req.status.finished:  # aborted while its KV arrived: the blocks are free to go now
                self.kv.free(req)
                continue
            if rid in kv_out.failed:  # recompute: a fresh start, without a pull
                self.kv.free(req)
                req.num_computed_tokens = 0
            else:
                req.num_computed_tokens += n_ext
                req.kv_state_arrived = self.connector.moves_running_state
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)

    def _count_prompt_tokens(self, req: Request, n: int) -> None:
        self.num_prompt_tokens_computed += max(0, min(n, req.num_prompt_tokens - req.num_computed_tokens))

    def _schedule_deferred(self, out: SchedulerOutput, deferred: list[Request], budget: int) -> None:
        """prefill-first: the decodes put off for the prompts, with the budget left, in running
        order; one that finds no blocks stops them (no preemption here: the requests scheduled
        above must keep theirs)."""
        for req in deferred:
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted above to make room
                continue
            pending = req.num_tokens - req.num_computed_tokens
            n = min(pending + len(req.spec_token_ids), budget)
            if n <= 0:
                continue
            drafts = req.spec_token_ids[:max(n - pending, 0)]
            if drafts and req.sampling_params.structured_outputs is not None:
                drafts, n = [], pending
            t_alloc = time.monotonic() if self.events is not None else 0.0
            new_blocks = self.kv.allocate_slots(req, n, None, self._lookahead(req.num_computed_tokens + n))
            if new_blocks is None:
                break
            self._add_cached(out.scheduled_cached_reqs, req, new_blocks, resumed=False)
            out.num_scheduled_tokens[req.request_id] = n
            self._count_prompt_tokens(req, n)
            if drafts:
                out.scheduled_spec_decode_tokens[req.request_id] = drafts
            if self.events is not None:
                self._log_running(req, n - len(drafts), t_alloc)
            budget -= n

    def _decode_first_fallback(self) -> SchedulerOutput:
        policy = self.config.policy
        self.config.policy = "decode-first"
        try:
            return self.schedule()
        finally:
            self.config.policy = policy

    def _lookahead(self, num_tokens: int) -> int:
        """MTP's lookahead slots past a step's ``num_tokens``: none from max_model_len on, where
        its drafts (and so its writes) never reach; the pool is sized for max_model_len."""
        return max(0, min(self.num_lookahead, self.max_model_len - num_tokens))

    def _grammar_bitmask(self, out: SchedulerOutput) -> None:
        """The tokens each constrained request that samples this step may sample."""
        rids = [rid for rid, n in out.num_scheduled_tokens.items()
                if (r := self.requests[rid]).sampling_params.structured_outputs is not None
                and r.num_computed_tokens + n >= r.num_tokens and self.structured_output.constrains(rid)]
        if rids:
            out.structured_output_request_ids = {rid: i for i, rid in enumerate(rids)}
            out.grammar_bitmask = self.structured_output.bitmask(rids)

    def _add_cached(self, cached: CachedRequestData, req: Request, new_blocks: KVCacheBlocks | None,
                    resumed: bool) -> None:
        cached.req_ids.append(req.request_id)
        cached.resumed_from_preemption.append(resumed)
        replaced = resumed or req.blocks_trimmed
        cached.block_ids_replaced.append(replaced)
        req.blocks_trimmed = False
        if replaced:  # every block is new, or the tables were cut back: the whole tables
            ids = self.kv.get_block_ids(req.request_id)
        else:  # the appended blocks, None when no group grew
            ids = new_blocks.get_block_ids()
            ids = ids if any(ids) else None
        cached.new_block_ids.append(ids)
        cached.num_computed_tokens.append(req.num_computed_tokens)

    def _log_running(self, req: Request, n: int, t_alloc: float) -> None:
        """Events of a running request's slice: a later prefill chunk (17, 18) or a decode (42)."""
        now = time.monotonic()
        blocks = self.kv.num_blocks_held(req.request_id)
        if req.num_output_tokens and n == 1:
            self._event(Step.KV_APPEND_SLOT, t_alloc, now, req, blocks=blocks)
        else:
            req.num_chunks += 1
            self._event(Step.SCHEDULER_CHUNK, t_alloc, t_alloc, req, chunk=req.num_chunks, tokens=n,
                        from_token=req.num_computed_tokens, prompt_tokens=req.num_prompt_tokens,
                        budget=self.config.max_num_batched_tokens)
            self._event(Step.KV_ALLOCATE, t_alloc, now, req, blocks=blocks)

    def _preempt(self, req: Request) -> None:
        """Recompute-style preemption: drop its blocks, put it back at the front."""
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []  # drafted from a state it no longer has
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # -- step 36 / 41: apply the model's output --------------------------------
    def update_from_output(self, sched: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        if (kv_out := runner_output.kv_connector_output) is not None:
            self._update_transfers(kv_out)
        index = runner_output.req_id_to_index
        for rid, n in sched.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished or aborted meanwhile
            req.num_computed_tokens += n
            i = index.get(rid)
            if i is None:
                self.kv.cache_blocks(req)
                continue  # a prefill chunk that is not the last one
            sampled = runner_output.sampled_token_ids[i]
            t_rollback = time.monotonic() if self.events is not None else 0.0
            if drafts := sched.scheduled_spec_decode_tokens.get(rid):
                req.num_computed_tokens -= len(drafts) - (len(sampled) - 1)  # step 48: the rejected
            logprobs = runner_output.logprobs[i] if runner_output.logprobs is not None else None
            new_ids: list[int] = []
            status = None
            constrained = self.structured_output is not None and req.sampling_params.structured_outputs is not None
            for tok in sampled:
                req.append_output_token(tok)
                new_ids.append(tok)
                if (status := self._check_stop(req, tok)) is not None:
                    break
                if constrained and self.structured_output.accept(rid, tok):  # the grammar is complete
                    status = RequestStatus.FINISHED_STOPPED
                    break
            # a stop inside accepted drafts: what follows it was computed but is not kept
            req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            self.kv.cache_blocks(req)  # verified tokens only: drafts never reach the prefix cache
            req.spec_token_ids = (runner_output.spec_token_ids[i] if runner_output.spec_token_ids
                                  and status is None else [])
            if drafts:
                self._rollback(req, len(drafts), len(sampled) - 1, status is None, t_rollback)
            out = EngineCoreOutput(rid, new_ids, logprobs[:len(new_ids)] if logprobs is not None else None,
                                   num_cached_tokens=max(req.num_cached_tokens, 0))
            if req.num_output_tokens == len(new_ids):  # its first tokens
                out.queued_ts, out.scheduled_ts = req.arrival_time, req.scheduled_ts
            if status is not None:
                self.running.remove(req)
                out.kv_transfer_params = self._finish(req, status)
                out.finish_reason = status.finish_reason
                out.stop_reason = req.stop_reason
            outputs.append(out)
        return outputs

    def _rollback(self, req: Request, num_drafts: int, num_accepted: int, running: bool, t0: float) -> None:
        """Step 48, after computed tokens fell back by the rejected drafts: blocks past what the
        next step allocates (its pending token, drafts and lookahead slots) go back to the pool.
        Those it will use stay: given back, the next step would take others from the free
        queue's head, evicting a cached prefix block each time."""
        rejected = num_drafts - num_accepted
        self.spec_stats.observe(num_drafts, num_accepted)
        freed = 0
        if rejected and running:
            keep = req.num_tokens + len(req.spec_token_ids)
            freed = self.kv.free_unused_slots(req, keep + self._lookahead(keep))
        req.blocks_trimmed |= freed > 0
        if self.events is not None:
            self._event(Step.KV_ROLLBACK, t0, time.monotonic(), req, drafts=num_drafts, accepted=num_accepted,
                        rejected=rejected, blocks_freed=freed, computed_tokens=req.num_computed_tokens)

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
            elif rid in self.waiting_for_remote:  # its blocks are being written: freed when the pull ends
                req.status = status
                del self.requests[rid]
                continue
            self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> dict | None:
        """Free its blocks (unless the KV connector keeps them for another engine); returns the
        connector's kv_transfer_params for the next engine."""
        log = self.events is not None
        t0 = time.monotonic() if log else 0.0
        req.status = status
        blocks = self.kv.num_blocks_held(req.request_id) if log else 0
        params = None
        delay = False
        if self.connector is not None:
            delay, params = self.connector.request_finished(req, self.kv.get_block_ids(req.request_id))
        if delay:  # another engine pulls them: freed when it says so, or at the connector's timeout
            self.delayed_free[req.request_id] = req
        else:
            self.kv.free(req)  # step 52
        if self.structured_output is not None:
            self.structured_output.finish(req.request_id)
        del self.requests[req.request_id]
        self.finished_req_ids.append(req.request_id)
        if log:
            self._event(Step.SCHEDULER_FINISH, t0, t0, req, reason=status.finish_reason,
                        output_tokens=req.num_output_tokens)
            self._event(Step.KV_FREE, t0, time.monotonic(), req, blocks=blocks, cached=self.kv.enable_caching,
                        **({"kept_for_transfer": True} if delay else {}))
        return params

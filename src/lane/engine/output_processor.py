"""Frontend-side output processing: detokenise, match stop strings, assemble
RequestOutputs, fan n > 1 samples back into one result (vLLM's OutputProcessor)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from lane.engine.messages import EngineCoreOutput
from lane.engine.detokenizer import IncrementalDetokenizer
from lane.metrics.stats import IterationStats, RequestStateStats
from lane.outputs import CompletionOutput, Logprob, RequestOutput
from lane.sampling_params import SamplingParams
from lane.transformers_utils.tokenizer import TokenStrings


@dataclass
class ChildState:
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    delta_start: int = 0  # token index where the current streaming delta begins
    stats: RequestStateStats | None = None  # timings, when the frontend keeps metrics


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: dict[str, ChildState]
    stream: bool = False  # hand out deltas as they come, else one final output
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None  # the engine's, with the last output

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: list[int] | None = None) -> None:
        self.tokenizer = tokenizer
        if eos_token_ids is None:
            eos_token_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.eos_token_ids = set(eos_token_ids)
        self.token_str = TokenStrings(tokenizer)  # logprobs' token strings
        self.states: dict[str, RequestState] = {}  # by parent id
        self.child_to_parent: dict[str, str] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, stream: bool = False,
                    arrival_time: float | None = None) -> list[tuple[str, SamplingParams]]:
        """Register a request; returns the (child id, params) pairs to send to the engine.
        An arrival_time turns on per-request timings for the metrics."""
        children: dict[str, ChildState] = {}
        pairs = []
        for i in range(params.n):
            cid = request_id if params.n == 1 else f"{i}_{request_id}"
            cp = params.for_child(i) if params.n > 1 else params
            detok = IncrementalDetokenizer(self.tokenizer, cp.stop, cp.skip_special_tokens,
                                           cp.include_stop_str_in_output, cp.min_tokens, prompt_token_ids)
            children[cid] = ChildState(
                i, cp, detok, logprobs=[] if cp.logprobs is not None else None,
                cumulative_logprob=0.0 if cp.logprobs is not None else None,
                stats=RequestStateStats(arrival_time) if arrival_time is not None else None)
            self.child_to_parent[cid] = request_id
            pairs.append((cid, cp))
        self.states[request_id] = RequestState(request_id, prompt, prompt_token_ids, children, stream)
        return pairs

    def process_outputs(self, outputs: list[EngineCoreOutput],
                        iteration_stats: IterationStats | None = None
                        ) -> tuple[list[RequestOutput], list[str]]:
        """Returns (request outputs to hand out, child ids the engine must stop:
        their stop string was found here). Fills iteration_stats when given."""
        now = time.monotonic() if iteration_stats is not None else 0.0
        touched: dict[str, RequestState] = {}
        to_abort: list[str] = []
        for o in outputs:
            pid = self.child_to_parent.get(o.request_id)
            if pid is None:
                continue
            state = self.states[pid]
            child = state.children[o.request_id]
            if child.finish_reason is not None:
                continue
            state.num_cached_tokens = o.num_cached_tokens
            child.token_ids.extend(o.new_token_ids)
            if o.new_logprobs and child.logprobs is not None:
                for tid, lp in zip(o.new_token_ids, o.new_logprobs):
                    child.logprobs.append(self._to_logprobs(tid, lp))
                    child.cumulative_logprob += lp[0]
            text_ids = o.new_token_ids
            if o.finish_reason == "stop" and text_ids and self._stop_token(text_ids[-1], o.stop_reason, child.params):
                text_ids = text_ids[:-1]  # the EOS / stop token that ended it is not text (vLLM)
            stop_str = child.detok.update(text_ids)
            if stop_str is not None:
                child.finish_reason, child.stop_reason = "stop", stop_str
                if o.finish_reason is None:
                    to_abort.append(o.request_id)
            elif o.finish_reason is not None:
                child.finish_reason, child.stop_reason = o.finish_reason, o.stop_reason
            if o.kv_transfer_params is not None:
                state.kv_transfer_params = o.kv_transfer_params
            if child.stats is not None and iteration_stats is not None:
                self._update_stats(child.stats, o, now, iteration_stats, child.finish_reason,
                                   len(state.prompt_token_ids))
            touched[pid] = state
        results = []
        for pid, state in touched.items():
            finished = state.finished
            if state.stream or finished:
                results.append(self._make_output(state, finished))
            if finished:
                self._remove(pid)
        return results, to_abort

    def _stop_token(self, token_id: int, stop_reason: int | str | None, params: SamplingParams) -> bool:
        """Whether the engine stopped on this token as a stop token (EOS, or one of
        stop_token_ids), not on a grammar's last token; with include_stop_str_in_output it
        stays text. Kept special tokens (DeepSeek's formats) would else end every answer."""
        if params.include_stop_str_in_output:
            return False
        return stop_reason == token_id if stop_reason is not None else token_id in self.eos_token_ids

    @staticmethod
    def _update_stats(stats: RequestStateStats, o: EngineCoreOutput, now: float,
                      iteration_stats: IterationStats, finish_reason: str | None,
                      num_prompt_tokens: int) -> None:
        if o.scheduled_ts:
            stats.queued_ts, stats.scheduled_ts = o.queued_ts, o.scheduled_ts
        stats.update(now, len(o.new_token_ids), iteration_stats, num_prompt_tokens)
        if finish_reason is not None:
            iteration_stats.finished.append(stats.finish(now, finish_reason, num_prompt_tokens))

    def _to_logprobs(self, tid: int, lp: tuple) -> dict[int, Logprob]:
        sampled_lp, rank, top = lp
        entry = {tid: Logprob(sampled_lp, rank, self.token_str(tid))}
        for r, (t, v) in enumerate(top, start=1):
            if t not in entry:
                entry[t] = Logprob(v, r, self.token_str(t))
        return entry

    def _make_output(self, state: RequestState, finished: bool) -> RequestOutput:
        """Deltas since the last output for a streaming request, else the whole text."""
        children = state.children
        if len(children) == 1:  # n = 1: no sorting, no search for the first
            (first,) = children.values()
            ordered = [first]
        else:
            ordered = sorted(children.values(), key=lambda c: c.index)
            first = ordered[0]
        outs = []
        for c in ordered:
            finished = c.finish_reason is not None
            if state.stream:
                text = c.detok.get_delta(finished)
                ids = c.token_ids[c.delta_start:]
                lps = c.logprobs[c.delta_start:] if c.logprobs is not None else None
                c.delta_start = len(c.token_ids)
            else:
                text, ids, lps = c.detok.output_text, list(c.token_ids), c.logprobs
            outs.append(CompletionOutput(c.index, text, ids, c.cumulative_logprob, lps,
                                         c.finish_reason, c.stop_reason))
        done = first.stats.finished if first.stats is not None else None
        metrics = done.timing_ms() if finished and done is not None else {}
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, outs,
                             finished, state.num_cached_tokens, metrics, state.kv_transfer_params)

    def abort(self, request_id: str, iteration_stats: IterationStats | None = None) -> list[str]:
        """Forget a request; returns its child ids (to abort in the engine). With
        iteration_stats, its unfinished children are counted there as finished by abort."""
        state = self.states.get(request_id)
        if state is None:
            return []
        self._remove(request_id)
        if iteration_stats is not None:
            now = time.monotonic()
            for c in state.children.values():
                if c.finish_reason is None and c.stats is not None:
                    iteration_stats.finished.append(c.stats.finish(now, "abort", len(state.prompt_token_ids)))
        return list(state.children)

    def _remove(self, pid: str) -> None:
        state = self.states.pop(pid)
        for cid in state.children:
            self.child_to_parent.pop(cid, None)

    def has_unfinished(self) -> bool:
        return bool(self.states)

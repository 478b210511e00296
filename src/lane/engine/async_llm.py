"""AsyncLLM: the API server's engine (vLLM's AsyncLLM). Tokenisation, chat
templates and detokenisation run here, in the frontend process; the engine cores
run in their own processes behind AsyncMPClient (seed steps 10-14, 37-40, 50, 56).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import AsyncIterator

from prometheus_client import CollectorRegistry

from lane.config import EngineArgs, EngineArgsError, SpeculativeConfig
from lane.engine.messages import EngineCoreOutputs, EngineCoreRequest
from lane.engine.core_client import AsyncMPClient, EngineDeadError
from lane.engine.dp_balancer import EngineOverloadedError
from lane.engine.output_processor import OutputProcessor
from lane.engine.processor import InputProcessor
from lane.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
from lane.metrics.stats import IterationStats
from lane.outputs import CompletionOutput, RequestOutput
from lane.sampling_params import ParamError, SamplingParams
from lane.tracing import Span, Step, TraceStore, tracer

logger = logging.getLogger(__name__)

# how long the frontend accumulates the token counts and latencies of the engines' messages
# before recording them in Prometheus and the log line (at once on a finished request, the
# engine's changed counts, a /metrics scrape): a dozen metric updates a message cost the
# event loop more than the message's own work at one token a step
STATS_FLUSH_S = 0.1


def default_served_name(model: str | None, model_config) -> str:
    """As vLLM: the --model argument as given; the embedded default is named by its model."""
    if model is not None:
        return model
    return model_config.short_name.split(".")[0]


def merge_deltas(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """One streaming output with the deltas of a and then b (b the later)."""
    earlier = {c.index: c for c in a.outputs}
    outs = []
    for c in b.outputs:
        p = earlier.pop(c.index, None)
        if p is None:
            outs.append(c)
            continue
        lps = None if p.logprobs is None and c.logprobs is None else (p.logprobs or []) + (c.logprobs or [])
        outs.append(CompletionOutput(c.index, p.text + c.text, p.token_ids + c.token_ids, c.cumulative_logprob,
                                     lps, c.finish_reason, c.stop_reason))
    if earlier:  # a choice b does not carry (it has none yet)
        outs = sorted([*outs, *earlier.values()], key=lambda c: c.index)
    return RequestOutput(b.request_id, b.prompt, b.prompt_token_ids, outs, b.finished, b.num_cached_tokens,
                         b.metrics)


class RequestStream:
    """What a request handler holds: the engine it went to and its outputs as they come.

    A streaming request's deltas that arrive while its handler has not yet taken the one before
    are merged into it (as vLLM's RequestOutputCollector does): a handler that falls behind under
    load writes one SSE chunk for several steps' tokens, not one per step, and catches up. A
    handler that keeps up (every stream at low load) sees one output per step. An error is queued
    after the outputs before it."""

    __slots__ = ("request_id", "engine_index", "finished", "_items", "_waiter")

    def __init__(self, request_id: str, engine_index: int) -> None:
        self.request_id = request_id
        self.engine_index = engine_index
        self.finished = False
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        items = self._items
        if items and isinstance(item, RequestOutput) and isinstance(items[-1], RequestOutput):
            items[-1] = merge_deltas(items[-1], item)
        else:
            items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> RequestOutput | BaseException:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.popleft()


class AsyncLLM:
    def __init__(self, args: EngineArgs, data_parallel_size: int = 1, served_model_name: str | None = None,
                 log_stats_interval_s: float = 5.0, trace_max_requests: int = 100,
                 max_num_waiting_requests: int | None = None) -> None:
        self.args = args
        self.max_num_waiting_requests = max_num_waiting_requests
        # the engines first: their imports and weight loading overlap the config and the
        # tokenizer here (seconds of a cold start)
        self.client = AsyncMPClient(args, data_parallel_size, self._on_outputs, self._on_engine_dead,
                                    self._on_spans, max_num_waiting_requests)
        self.client.launch()
        try:
            self.model_config = args.create_model_config()
            args.create_parallel_config().check_model(self.model_config.hf_config)
            if (spec := SpeculativeConfig.parse(args.speculative_config)) is not None:
                spec.check_model(self.model_config.hf_config, (self.model_config.architectures or ["?"])[0])
        except (ValueError, FileNotFoundError, TypeError) as e:  # a bad flag: the engines fail on it too
            self.client.shutdown()
            raise EngineArgsError(str(e)) from None
        except BaseException:
            self.client.shutdown()
            raise
        self.served_model_name = served_model_name or default_served_name(args.model, self.model_config)
        self.tokenizer = self.model_config.get_tokenizer()
        self.processor = InputProcessor(self.model_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer, self.model_config.eos_token_ids)
        self.registry = CollectorRegistry()
        self.prometheus = PrometheusStatLogger(self.served_model_name, data_parallel_size, self.registry)
        self.log_stats = [LoggingStatLogger(i) for i in range(data_parallel_size)]
        self.log_stats_interval_s = log_stats_interval_s
        self.streams: dict[str, RequestStream] = {}
        self._pending_stats: dict[int, tuple[IterationStats, float]] = {}  # engine -> (stats, since)
        self._log_task: asyncio.Task | None = None
        self.traces: TraceStore | None = None
        if args.enable_tracing:  # the seed's steps, kept for the last requests
            self.traces = TraceStore(trace_max_requests)
            tracer.enable(args.trace_layers)
            tracer.sink = self.traces.add

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_model_len

    async def start(self) -> None:
        t0 = time.monotonic()
        await self.client.start()
        if self.traces is not None:
            for r in self.client.ready:
                self._on_spans(r.spans or [])
                self.traces.skipped.update(r.skipped or {})
                self.traces.occasional.update(r.occasional or {})
            # step 9: from the last engine's start-up work to the frontend seeing it ready
            ends = [s.start + s.dur for s in self.traces.startup] or [t0]
            tracer.record(Step.ENGINE_READY, max(ends), time.monotonic(), engines=len(self.client.ready))
        for r in self.client.ready:
            self.prometheus.log_engine_initialized(
                r.engine_index, r.block_size, r.num_gpu_blocks, r.enable_prefix_caching,
                str(self.model_config.dtype).removeprefix("torch.") if self.args.kv_cache_dtype == "auto"
                else self.args.kv_cache_dtype, r.kv_cache_bytes)  # C8: the cache as stored
        if self.log_stats_interval_s > 0:
            self._log_task = asyncio.create_task(self._log_loop(), name="log-stats")

    async def _log_loop(self) -> None:
        while True:
            await asyncio.sleep(self.log_stats_interval_s)
            self.flush_stats()
            for stat_logger in self.log_stats:
                stat_logger.log()

    def shutdown(self) -> None:
        if self._log_task is not None:
            self._log_task.cancel()
        self.client.shutdown()

    @property
    def is_healthy(self) -> bool:
        return self.client.all_alive

    # -- requests --------------------------------------------------------------
    def route(self, request_ids: list[str], n: int, data_parallel_rank: int | None = None) -> list[int]:
        """The engine for each prompt of one API request (n samples each), all chosen before
        any is sent: a request the waiting queues cannot take is refused whole
        (EngineOverloadedError, counted in the metrics) and never reaches an engine."""
        if not self.is_healthy:
            raise EngineDeadError("an engine core is not running")
        bound = self.max_num_waiting_requests
        if bound is not None and len(request_ids) * n > bound:  # it could never be queued
            raise ParamError("n" if len(request_ids) == 1 else "prompt", (
                f"this request asks for {len(request_ids) * n} sequences ({len(request_ids)} prompt(s) x "
                f"n={n}); an engine queues at most {bound} (--max-num-waiting-requests)"))
        t0 = time.monotonic() if tracer.enabled else 0.0
        engines: list[int] = []
        try:
            for _ in request_ids:
                engines.append(self.client.choose_engine(data_parallel_rank, n))
        except EngineOverloadedError as e:
            for engine in engines:
                self.client.balancer.release(engine, n)
            self.prometheus.record_refused(e.engine_index)
            logger.debug("Refused request %s: %s", request_ids[0], e)
            raise
        if tracer.enabled:  # step 13
            now = time.monotonic()
            for rid, engine in zip(request_ids, engines):
                tracer.record(Step.DP_ROUTE, t0, now, [rid], engine=engine, pinned=data_parallel_rank is not None,
                              scores=[load.score for load in self.client.balancer.loads])
        return engines

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, stream: bool, data_parallel_rank: int | None = None,
                    engine_index: int | None = None) -> RequestStream:
        """Send a validated request to an engine: engine_index if route() chose it, else the
        balancer's pick (or the pinned rank)."""
        if not self.is_healthy:
            raise EngineDeadError("an engine core is not running")
        engine = (engine_index if engine_index is not None
                  else self.route([request_id], params.n, data_parallel_rank)[0])
        handle = RequestStream(request_id, engine)
        pairs = self.output_processor.add_request(request_id, prompt, prompt_token_ids, params, stream,
                                                  arrival_time=time.monotonic())
        self.streams[request_id] = handle
        try:
            for cid, cp in pairs:
                self.client.add_request(engine, EngineCoreRequest(cid, prompt_token_ids, cp))
        except Exception:
            self.abort(request_id)
            raise
        logger.debug("Added request %s to engine %d", request_id, engine)
        return handle

    async def outputs(self, handle: RequestStream) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes. Leaving early (a client that went
        away, a cancelled task) aborts it, and the engine frees its KV blocks."""
        try:
            while True:
                item = await handle.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    handle.finished = True
                yield item
                if handle.finished:
                    return
        finally:
            if not handle.finished:
                self.abort(handle.request_id)

    def abort(self, request_id: str) -> None:
        handle = self.streams.pop(request_id, None)
        stats = IterationStats()
        child_ids = self.output_processor.abort(request_id, stats)
        if handle is not None and stats.finished:  # vllm:request_success_total{finished_reason="abort"}
            self.prometheus.record(handle.engine_index, None, stats)
        if handle is not None and child_ids:
            try:
                self.client.abort_requests(handle.engine_index, child_ids)
            except Exception:  # the engine is gone: nothing to free
                pass
            logger.debug("Aborted request %s", request_id)

    # -- engine callbacks ------------------------------------------------------
    def _on_spans(self, spans: list[Span]) -> None:
        if self.traces is not None:
            for span in spans:
                self.traces.add(span)

    def flush_stats(self) -> None:
        """Record what the engines' messages brought since the last flush (before /metrics answers)."""
        for i in list(self._pending_stats):
            self._record_stats(i, None)

    def _record_stats(self, engine_index: int, scheduler_stats) -> None:
        pending = self._pending_stats.pop(engine_index, None)
        iteration_stats = pending[0] if pending is not None else None
        self.prometheus.record(engine_index, scheduler_stats, iteration_stats)
        self.log_stats[engine_index].record(scheduler_stats, iteration_stats)

    def _on_outputs(self, outs: EngineCoreOutputs) -> None:
        engine = outs.engine_index
        pending = self._pending_stats.get(engine)
        if pending is None:
            pending = self._pending_stats[engine] = (IterationStats(), time.monotonic())
        iteration_stats = pending[0]
        t0 = time.monotonic() if tracer.enabled else 0.0
        request_outputs, to_abort = self.output_processor.process_outputs(outs.outputs, iteration_stats)
        if tracer.enabled and request_outputs:  # step 38
            tracer.record(Step.TOKENIZER_DECODE, t0, time.monotonic(), [ro.request_id for ro in request_outputs],
                          tokens=sum(len(o.new_token_ids) for o in outs.outputs))
        for ro in request_outputs:
            handle = self.streams.get(ro.request_id)
            if handle is None:
                continue
            handle.put(ro)
            if ro.finished:
                del self.streams[ro.request_id]
        if to_abort:  # stop strings found by the detokenizer
            self.client.abort_requests(engine, to_abort)
        if (outs.scheduler_stats is not None or iteration_stats.finished
                or time.monotonic() - pending[1] >= STATS_FLUSH_S):
            self._record_stats(engine, outs.scheduler_stats)

    def _on_engine_dead(self, engine_index: int, exitcode: int | None) -> None:
        why = self.client.errors.get(engine_index)
        err = EngineDeadError(f"engine core {engine_index} stopped on a runtime error ({why}); the request "
                              f"cannot finish" if why is not None else
                              f"engine core {engine_index} died (exit code {exitcode}); the request cannot finish")
        for rid, handle in list(self.streams.items()):
            if handle.engine_index == engine_index:
                self.output_processor.abort(rid)
                del self.streams[rid]
                handle.put(err)

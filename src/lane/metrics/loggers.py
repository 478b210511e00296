"""Stat loggers (seed step 56): Prometheus collectors under vLLM's metric names,
``vllm:`` prefix included, so vLLM dashboards, AISBench and ``lane bench`` read them;
and a log line every few seconds, in vLLM's words."""
from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from lane.metrics.stats import IterationStats, SchedulerStats, SpecDecodingStats

logger = logging.getLogger(__name__)

# a rearrangement: a few ms on a tiny model, seconds for a big one
EPLB_SECONDS_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
# vLLM's buckets
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000]
FINISH_REASONS = ("stop", "length", "abort")


class PrometheusStatLogger:
    def __init__(self, model_name: str, num_engines: int, registry: CollectorRegistry) -> None:
        self.registry = registry
        labels = ["model_name", "engine"]

        def gauge(name, doc, extra=()):
            return Gauge(name, doc, labels + list(extra), registry=registry)

        def counter(name, doc, extra=()):
            return Counter(name, doc, labels + list(extra), registry=registry)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.spec_accepted_per_pos = counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Accepted tokens per draft position.", ["position"])
        # counted by the frontend: a refused request never reaches the engine it is labelled with
        self.refused = counter("vllm:num_requests_refused",
                               "Requests refused with 503 because the engine they would go to had "
                               "--max-num-waiting-requests waiting.")
        self.ignored_fields = Counter("lane:request_ignored_fields", "Requests that carried a field lane does "
                                      "not implement (ignored), by field name.", ["model_name", "field"],
                                      registry=registry)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self.request_success = counter("vllm:request_success", "Count of successfully processed requests.",
                                       ["finished_reason"])
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        REQUEST_LATENCY_BUCKETS)
        self.req_prompt_tokens = histogram("vllm:request_prompt_tokens",
                                           "Number of prefill tokens processed.", TOKEN_BUCKETS)
        self.req_generation_tokens = histogram("vllm:request_generation_tokens",
                                               "Number of generation tokens processed.", TOKEN_BUCKETS)
        # EPLB (--enable-eplb): vLLM's proposed names where it has them (README, "EPLB metrics")
        self.eplb_balancedness_min = gauge("vllm:eplb_balancedness_min",
                                           "Mean over max tokens per expert-parallel rank, worst MoE layer, "
                                           "over the last EPLB window.")
        self.eplb_balancedness_p50 = gauge("vllm:eplb_balancedness_p50",
                                           "Mean over max tokens per expert-parallel rank, median MoE layer, "
                                           "over the last EPLB window.")
        self.eplb_rebalance_events = counter("vllm:eplb_rebalance_events", "EPLB rearrangements decided.")
        self.eplb_rebalancing = gauge("vllm:eplb_rebalancing", "1 while EPLB is moving expert weights.")
        self.eplb_seconds = histogram("lane:eplb_rearrangement_seconds",
                                      "Time of each EPLB rearrangement: heat gathered, placement, weights moved.",
                                      EPLB_SECONDS_BUCKETS)
        self.eplb_moved_bytes = counter("lane:eplb_moved_bytes", "Expert weight bytes EPLB sent between ranks.")
        # PD disaggregation (--kv-transfer-config), and what any engine computed of its prompts
        self.prompt_tokens_computed = counter("lane:prompt_tokens_computed",
                                              "Prompt tokens this engine computed: not found in the prefix cache "
                                              "nor transferred from another engine.")
        self.kv_transfer_bytes = counter("lane:kv_transfer_bytes", "KV cache bytes moved between engines.")
        self.kv_transfer_seconds = histogram("lane:kv_transfer_seconds", "Time of each step's KV transfers.",
                                             EPLB_SECONDS_BUCKETS)
        self.kv_transfer_failures = counter("lane:kv_transfer_failures",
                                            "Requests whose KV cache could not be transferred.")
        self.kv_transfer_expired = counter("lane:kv_transfer_expired_requests",
                                           "Requests whose KV cache no engine pulled before the timeout.")
        # data-parallel attention (-dp N --enable-expert-parallel): the replicas' lock-step
        self.dp_imbalance = gauge("lane:dp_imbalance",
                                  "Most tokens a data-parallel replica scheduled over the mean, the last 64 steps.")
        self.dp_dummy_batches = counter("lane:dp_dummy_batches",
                                        "Steps a replica ran a dummy batch so the others' MoE collectives met.")
        self.dp_frozen_steps = counter("lane:dp_admission_frozen_steps",
                                       "Steps no replica admitted a request because one was at --max-num-seqs.")
        self.cache_config_info = Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            ["model_name", "engine", "block_size", "num_gpu_blocks", "enable_prefix_caching",
             "cache_dtype", "kv_cache_memory_bytes"], registry=registry)
        self.model_name = model_name
        self._last: dict[int, SchedulerStats] = {}
        for i in range(num_engines):  # every series exists from the start (dashboards want zeros)
            lv = (model_name, str(i))
            for metric in (self.running, self.waiting, self.kv_usage, self.prefix_queries, self.prefix_hits,
                           self.preemptions, self.refused, self.prompt_tokens, self.generation_tokens,
                           self.prompt_tokens_computed):
                metric.labels(*lv)
            for reason in FINISH_REASONS:
                self.request_success.labels(*lv, reason)

    def log_engine_initialized(self, engine_index: int, block_size: int, num_blocks: int,
                               enable_prefix_caching: bool, cache_dtype: str, kv_cache_bytes: int) -> None:
        self.cache_config_info.labels(self.model_name, str(engine_index), str(block_size), str(num_blocks),
                                      str(enable_prefix_caching), cache_dtype, str(kv_cache_bytes)).set(1)

    def record_ignored_fields(self, fields: list[str]) -> None:
        for f in fields:
            self.ignored_fields.labels(self.model_name, f[:64]).inc()

    def record_refused(self, engine_index: int) -> None:
        self.refused.labels(self.model_name, str(engine_index)).inc()

    def record(self, engine_index: int, scheduler_stats: SchedulerStats | None,
               iteration_stats: IterationStats | None) -> None:
        lv = (self.model_name, str(engine_index))
        if scheduler_stats is not None:
            s, last = scheduler_stats, self._last.get(engine_index, SchedulerStats())
            self.running.labels(*lv).set(s.num_running_reqs)
            self.waiting.labels(*lv).set(s.num_waiting_reqs)
            self.kv_usage.labels(*lv).set(s.kv_cache_usage)
            self.prefix_queries.labels(*lv).inc(max(s.prefix_cache_queries - last.prefix_cache_queries, 0))
            self.prefix_hits.labels(*lv).inc(max(s.prefix_cache_hits - last.prefix_cache_hits, 0))
            self.preemptions.labels(*lv).inc(max(s.num_preemptions - last.num_preemptions, 0))
            if s.spec_decoding is not None:
                d = s.spec_decoding.since(last.spec_decoding)
                self.spec_drafts.labels(*lv).inc(d.num_drafts)
                self.spec_draft_tokens.labels(*lv).inc(d.num_draft_tokens)
                self.spec_accepted.labels(*lv).inc(d.num_accepted_tokens)
                for pos, n in enumerate(d.num_accepted_tokens_per_pos):
                    self.spec_accepted_per_pos.labels(*lv, str(pos)).inc(n)
            if s.eplb is not None:
                self._record_eplb(lv, s.eplb, last.eplb)
            self.prompt_tokens_computed.labels(*lv).inc(max(s.prompt_tokens_computed - last.prompt_tokens_computed, 0))
            if s.kv_transfer is not None:
                self._record_kv_transfer(lv, s.kv_transfer, last.kv_transfer)
            if s.dp is not None:
                self.dp_imbalance.labels(*lv).set(s.dp.imbalance)
                self.dp_dummy_batches.labels(*lv).inc(max(s.dp.dummy_batches - (last.dp.dummy_batches if last.dp else 0), 0))
                self.dp_frozen_steps.labels(*lv).inc(max(s.dp.frozen_steps - (last.dp.frozen_steps if last.dp else 0), 0))
            self._last[engine_index] = s
        if iteration_stats is None:
            return
        it = iteration_stats
        self.prompt_tokens.labels(*lv).inc(it.num_prompt_tokens)
        self.generation_tokens.labels(*lv).inc(it.num_generation_tokens)
        for v in it.time_to_first_tokens:
            self.ttft.labels(*lv).observe(v)
        for v in it.inter_token_latencies:
            self.itl.labels(*lv).observe(v)
        for f in it.finished:
            self.request_success.labels(*lv, f.finish_reason).inc()
            self.e2e.labels(*lv).observe(f.e2e_latency)
            self.queue_time.labels(*lv).observe(f.queued_time)
            self.prefill_time.labels(*lv).observe(f.prefill_time)
            self.decode_time.labels(*lv).observe(f.decode_time)
            self.inference_time.labels(*lv).observe(f.inference_time)
            self.req_prompt_tokens.labels(*lv).observe(f.num_prompt_tokens)
            self.req_generation_tokens.labels(*lv).observe(f.num_generation_tokens)
            if f.num_generation_tokens > 1:
                self.tpot.labels(*lv).observe(f.decode_time / (f.num_generation_tokens - 1))


    def _record_eplb(self, lv: tuple, e, last) -> None:
        self.eplb_balancedness_min.labels(*lv).set(e.balancedness_min)
        self.eplb_balancedness_p50.labels(*lv).set(e.balancedness_p50)
        self.eplb_rebalancing.labels(*lv).set(int(e.rebalancing))
        self.eplb_rebalance_events.labels(*lv).inc(max(e.rebalance_events - (last.rebalance_events if last else 0), 0))
        self.eplb_moved_bytes.labels(*lv).inc(max(e.moved_bytes - (last.moved_bytes if last else 0), 0))
        for seconds in e.rearrangement_seconds[len(last.rearrangement_seconds) if last else 0:]:
            self.eplb_seconds.labels(*lv).observe(seconds)


    def _record_kv_transfer(self, lv: tuple, k, last) -> None:
        self.kv_transfer_bytes.labels(*lv).inc(max(k.bytes - (last.bytes if last else 0), 0))
        self.kv_transfer_failures.labels(*lv).inc(max(k.failures - (last.failures if last else 0), 0))
        self.kv_transfer_expired.labels(*lv).inc(max(k.expired - (last.expired if last else 0), 0))
        for seconds in k.new_seconds(last):
            self.kv_transfer_seconds.labels(*lv).observe(seconds)


class LoggingStatLogger:
    """One INFO line per engine every interval while there is something to say."""

    def __init__(self, engine_index: int) -> None:
        self.engine_index = engine_index
        self.stats = SchedulerStats()
        self._reset(time.monotonic())
        self._logged_idle = True

    def _reset(self, now: float) -> None:
        self.last_log_time = now
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.queries_at_last_log = self.stats.prefix_cache_queries
        self.hits_at_last_log = self.stats.prefix_cache_hits
        self.spec_at_last_log = self.stats.spec_decoding

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        if scheduler_stats is not None:
            self.stats = scheduler_stats
        if iteration_stats is not None:
            self.num_prompt_tokens += iteration_stats.num_prompt_tokens
            self.num_generation_tokens += iteration_stats.num_generation_tokens

    def log(self) -> None:
        now = time.monotonic()
        s = self.stats
        idle = not (self.num_prompt_tokens or self.num_generation_tokens or s.num_running_reqs
                    or s.num_waiting_reqs)
        if idle and self._logged_idle:
            self._reset(now)
            return
        dt = max(now - self.last_log_time, 1e-9)
        queries = s.prefix_cache_queries - self.queries_at_last_log
        hits = s.prefix_cache_hits - self.hits_at_last_log
        logger.info(
            "Engine %03d: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            self.engine_index, self.num_prompt_tokens / dt, self.num_generation_tokens / dt,
            s.num_running_reqs, s.num_waiting_reqs, 100 * s.kv_cache_usage,
            100 * hits / queries if queries else 0.0)
        if s.spec_decoding is not None:
            self._log_spec(s.spec_decoding.since(self.spec_at_last_log))
        self._logged_idle = idle
        self._reset(now)

    def _log_spec(self, d: SpecDecodingStats) -> None:
        drafts, proposed, accepted = d.num_drafts, d.num_draft_tokens, d.num_accepted_tokens
        if not drafts:
            return
        per_pos = [n / drafts for n in d.num_accepted_tokens_per_pos]
        logger.info("SpecDecoding metrics: Mean acceptance length: %.2f, Drafted: %d tokens, Accepted: %d tokens, "
                    "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
                    1 + accepted / drafts, proposed, accepted,
                    ", ".join(f"{r:.3f}" for r in per_pos), 100 * accepted / proposed if proposed else 0.0)

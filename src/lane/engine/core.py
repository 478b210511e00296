"""EngineCore: the scheduler, the KV manager and the worker, stepped in a loop
(seed steps 8, 9, 14, 15-19, 35-37); EngineCoreProc runs it in its own process
(lane serve): requests come in over ZeroMQ, outputs go out on a Unix socket
(messages.frame), both msgspec-encoded."""
from __future__ import annotations

import gc
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, replace

import msgspec

from lane.config import EngineConfig
from lane.core.request import Request, RequestStatus
from lane.core.scheduler import Scheduler
from lane.kv_cache_interface import SLIDING_WINDOW
from lane.engine.messages import (EngineCoreOutput, EngineCoreOutputs, EngineCoreOutputType, EngineCoreRequest,
                                  EngineCoreRequestType, EngineReady, frame)
from lane.logger import configure_process_logging
from lane.metrics.stats import SchedulerStats
from lane.tracing import DECODE_STEP, Step, occasional_steps, skipped_steps, tracer
from lane.model_executor.layers import cpu_kernels
from lane.executor import Executor

logger = logging.getLogger(__name__)



def start_cpu_kernel_build() -> None:
    """On a CPU, start compiling (or loading) the kernels before the config and the
    weights: the compiler's seconds on a first start overlap them."""
    from lane import platform

    if platform.default_device().type == "cpu":
        cpu_kernels.start_build()


class StepLog:
    """LANE_STEP_LOG=PATH: one JSON object per engine step, appended to PATH ("{pid}" in it is
    replaced by the engine's pid, for several engines): when it started (time.monotonic()), how
    long scheduling, the model and the update took (ms), and how the step's token budget was spent:
    prefill tokens and the requests they belong to, decode rows, first tokens sampled, waiting and
    running requests after scheduling; in lane serve, how long encoding and sending the step
    before's outputs took (us). What benchmarks/scheduler_budget.py and
    benchmarks/serving_overhead.py read; off, a step costs one attribute test."""

    def __init__(self, path: str) -> None:
        self.f = open(path.replace("{pid}", str(os.getpid())), "a")
        self._flushed = time.monotonic()
        self.send_s = 0.0  # set by EngineCoreProc: encoding and sending the last step's outputs

    def record(self, start: float, t0: float, t1: float, t2: float, t3: float, tokens: int, prefill_tokens: int,
               prefill_reqs: int, decode_rows: int, first_tokens: int, waiting: int, running: int) -> None:
        """start: time.monotonic() at the step's start; t0-t3: perf_counter() at its start, after
        scheduling, after the model, after the update."""
        self.f.write(f'{{"t": {start:.6f}, "sched_ms": {(t1 - t0) * 1e3:.3f}, "exec_ms": {(t2 - t1) * 1e3:.3f}, '
                     f'"update_ms": {(t3 - t2) * 1e3:.3f}, "tokens": {tokens}, '
                     f'"prefill_tokens": {prefill_tokens}, "prefill_reqs": {prefill_reqs}, '
                     f'"decode_rows": {decode_rows}, "first_tokens": {first_tokens}, "waiting": {waiting}, '
                     f'"running": {running}, "prev_send_us": {self.send_s * 1e6:.1f}}}\n')
        self.send_s = 0.0
        if start - self._flushed > 1.0:  # a reader sees it within a second; not a syscall a step
            self.f.flush()
            self._flushed = start

    def close(self) -> None:
        self.f.close()


class EngineCore:
    def __init__(self, config: EngineConfig, own_process: bool = False) -> None:
        t0 = time.perf_counter()
        self.config = config
        path = os.environ.get("LANE_STEP_LOG")
        self.step_log = StepLog(path) if path else None
        self.executor = Executor.create(config, own_process)
        cc = config.cache_config
        t_pool = time.monotonic()
        self.kv_cache_config = kv = self.executor.initialize_kv_cache()  # handed to the scheduler as it is
        if tracer.enabled:  # step 8
            tracer.record(Step.KV_INIT_POOL, t_pool, time.monotonic(), blocks=kv.num_blocks[0] - 1,
                          block_size=kv.block_size, groups=[g.kind for g in kv.groups],
                          budget_mib=round(cc.budget_bytes() / 2**20, 1))
        self.warmup_s = self.executor.warmup()
        self.scheduler = Scheduler(config.scheduler_config, kv, cc.enable_prefix_caching,
                                   config.model_config.eos_token_ids, log_events=tracer.enabled,
                                   speculative_config=config.speculative_config,
                                   structured_output=self._structured_output_manager,
                                   kv_connector=self._kv_connector(kv))
        self.kv_cache_bytes = kv.total_bytes
        self.eplb_stats = None  # the workers' latest EPLB figures (--enable-eplb)
        # data-parallel attention: every replica steps when any does (EngineCoreProc keeps time)
        self.lockstep = config.parallel_config.data_parallel_expert
        self.num_dummy_batches = 0
        self.last_scheduled_tokens = 0
        self.dp_attrs: dict = {}  # the balancer's figures for this step's trace (step 15)
        self.dp_stats = None  # the lock-step's figures (EngineCoreProc's DPCoordinator keeps them)
        # what start-up made (modules, weights' wrappers, the tokenizer) lives as long as the
        # engine: frozen, the collector stops re-walking it, 2-3 % of a decode step (as vLLM's
        # EngineCore does)
        gc.collect()
        gc.freeze()
        self.init_s = time.perf_counter() - t0
        mc = config.model_config
        logger.info("Model %s: %s, dtype %s, %d threads, CPU kernels %s, max_model_len %d",
                    mc.short_name, mc.architectures[0] if mc.architectures else "?",
                    str(mc.dtype).removeprefix("torch."), self.executor.threads,
                    f"on ({cpu_kernels.isa()})" if cpu_kernels.available() else "off", mc.max_model_len)
        others = "".join(f" + a sliding-window pool of {n - 1} blocks ({g.sliding_window}-token windows)"
                         if g.kind == SLIDING_WINDOW else f" + {n - 1} running-state slots"
                         for g, n in zip(kv.groups[1:], kv.num_blocks[1:]))
        logger.info("KV cache: %d blocks x %d tokens = %d tokens%s (%.1f MiB of a %.1f MiB budget); "
                    "prefix caching %s; init (load, KV pool, warm-up) took %.2f s",
                    kv.num_blocks[0] - 1, kv.block_size, (kv.num_blocks[0] - 1) * kv.block_size, others,
                    self.kv_cache_bytes / 2**20, cc.budget_bytes() / 2**20,
                    "on" if cc.enable_prefix_caching else "off", self.init_s)

    def _kv_connector(self, kv):
        """The scheduler's half of the KV connector (--kv-transfer-config), or None."""
        ktc = self.config.kv_transfer_config
        if ktc is None:
            return None
        from lane.kv_transfer.base import KVConnectorRole, layout_of
        from lane.kv_transfer.factory import create_connector

        mc, pc = self.config.model_config, self.config.parallel_config
        return create_connector(ktc, KVConnectorRole.SCHEDULER, kv, layout_of(mc, kv), 0, pc.world_size)

    def _structured_output_manager(self):
        """Made when the first request with structured outputs arrives; it loads the tokenizer
        (and xgrammar's tables of it) in its compile thread, not in this loop."""
        from lane.structured_output.manager import StructuredOutputManager

        mc = self.config.model_config
        return StructuredOutputManager(mc.get_tokenizer, mc.hf_config.vocab_size, mc.eos_token_ids)

    @property
    def worker(self):
        """The in-process Worker of a one-rank engine (None when the ranks are processes)."""
        return self.executor.driver_worker

    @property
    def transport(self) -> str:
        pc = self.config.parallel_config
        if pc.backend == "uni":
            return "in-process call (TP=1)"
        if pc.backend == "ray":
            return f"Ray actor calls to {pc.world_size} ranks"
        return (f"shared-memory broadcast to {pc.ranks_per_node} local ranks"
                + (f", ZeroMQ to {pc.world_size - pc.ranks_per_node} on other nodes" if pc.nnodes > 1 else ""))

    def shutdown(self) -> None:
        if self.step_log is not None:
            self.step_log.close()
        self.executor.shutdown()
        # start-up froze what it made (gc.freeze above): hand it back to the collector, or an
        # in-process engine (LLM) would keep its model and KV pool for the life of the process
        gc.unfreeze()

    @property
    def max_model_len(self) -> int:
        return self.config.model_config.max_model_len

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request the frontend's InputProcessor has validated (step 14)."""
        self.scheduler.add_request(Request(  # its arrival_time: now, in the engine's queue
            req.request_id, list(req.prompt_token_ids), req.sampling_params, cache_salt=req.cache_salt))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        if tracer.enabled:
            self._record_events()

    def _record_events(self) -> None:
        """The scheduler's per-request events, as spans."""
        for e in self.scheduler.drain_events():
            tracer.record(e.step, e.start, e.end, [e.request_id], **e.attrs)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self.scheduler.has_connector_work()

    def _schedule(self):
        so = self.scheduler.schedule()
        self.last_scheduled_tokens = so.total_num_scheduled_tokens
        return so

    def _idle_step(self) -> list[EngineCoreOutput]:
        """Nothing to compute: with KV transfers under way, the workers still hear of them and
        say what finished (a pause between such steps, not a spin). In lock-step with other
        replicas (data-parallel attention), a dummy batch, so their MoE collectives meet ours."""
        if self.scheduler.has_connector_work():
            so = self.scheduler.connector_step()
            out = self._execute(so)
            self.scheduler.update_from_output(so, out)
            if out.kv_connector_output is None and not self.lockstep:
                time.sleep(0.002)
        if self.lockstep:
            self.execute_dummy_batch()
        return []

    def execute_dummy_batch(self) -> None:
        """One forward of one dummy token on every rank (writing only the null block), for the
        collectives of replicas in lock-step; EPLB counts it as a step like the others do theirs."""
        out = self.executor.collective_rpc("execute_dummy_batch", unique_reply_rank=0)
        if out is not None:
            self.eplb_stats = out
        self.num_dummy_batches += 1

    def _execute(self, so):
        out = self.executor.execute_model(so)
        if out.eplb_stats is not None:
            self.eplb_stats = out.eplb_stats
        return out

    def make_stats(self) -> SchedulerStats:
        """The scheduler's counts, with the workers' EPLB figures and the lock-step's."""
        stats = self.scheduler.make_stats()
        stats.eplb = self.eplb_stats
        if self.dp_stats is not None:
            stats.dp = replace(self.dp_stats, dummy_batches=self.num_dummy_batches, running=list(self.dp_stats.running))
        return stats

    def step(self) -> list[EngineCoreOutput]:
        if tracer.enabled:
            return self._traced_step()
        if self.step_log is not None:
            return self._logged_step()
        so = self._schedule()
        if so.is_empty:
            return self._idle_step()
        return self.scheduler.update_from_output(so, self._execute(so))

    def _logged_step(self) -> list[EngineCoreOutput]:
        """step(), writing how its budget went and its times to the step log."""
        start, t0 = time.monotonic(), time.perf_counter()
        sched = self.scheduler
        so = self._schedule()
        if so.is_empty:
            return self._idle_step()
        t1 = time.perf_counter()
        spec = so.scheduled_spec_decode_tokens
        prefill_tokens = prefill_reqs = decode_rows = 0
        for rid, n in so.num_scheduled_tokens.items():
            if n - len(spec.get(rid, ())) == 1 and sched.requests[rid].num_output_tokens:
                decode_rows += 1
            else:
                prefill_tokens += n
                prefill_reqs += 1
        runner_output = self._execute(so)
        t2 = time.perf_counter()
        outputs = sched.update_from_output(so, runner_output)
        t3 = time.perf_counter()
        self.step_log.record(start, t0, t1, t2, t3, so.total_num_scheduled_tokens, prefill_tokens, prefill_reqs,
                             decode_rows, sum(1 for o in outputs if o.scheduled_ts), len(sched.waiting),
                             len(sched.running))
        return outputs

    def _traced_step(self) -> list[EngineCoreOutput]:
        """step() recording the engine's spans; a decoding request sees an engine-level
        span under its decode-loop number (15 -> 43, 19 -> 44, 35 -> 49, 36 -> 41)."""
        t0 = time.monotonic()
        so = self._schedule()
        t1 = time.monotonic()
        self._record_events()
        if so.is_empty:
            return self._idle_step()
        reqs = self.scheduler.requests
        spec = so.scheduled_spec_decode_tokens
        decode = [rid for rid, n in so.num_scheduled_tokens.items()
                  if n - len(spec.get(rid, ())) == 1 and reqs[rid].num_output_tokens]
        decode_set = set(decode)
        prefill = [rid for rid in so.num_scheduled_tokens if rid not in decode_set]
        batch = dict(batch=len(so.num_scheduled_tokens), tokens=so.total_num_scheduled_tokens)

        def both(step: Step, start: float, end: float, **attrs) -> None:
            if prefill:
                tracer.record(step, start, end, prefill, **batch, **attrs)
            if decode:
                tracer.record(DECODE_STEP[step], start, end, decode, **batch, **attrs)

        both(Step.SCHEDULER_SCHEDULE, t0, t1, running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
             **self.dp_attrs)
        t2 = time.monotonic()
        both(Step.ENGINE_DISPATCH, t1, t2, transport=self.transport)
        runner_output = self._execute(so)
        t3 = time.monotonic()
        last = tracer.spans[-1] if tracer.spans else None
        both(Step.WORKER_RETURN, last.start + last.dur if last is not None and last.step == Step.RUNNER_SAMPLE
             else t3, t3)
        outputs = self.scheduler.update_from_output(so, runner_output)
        both(Step.SCHEDULER_UPDATE, t3, time.monotonic(), finished=sum(o.finish_reason is not None for o in outputs))
        self._record_events()
        return outputs


# -- the engine-core process (lane serve) ------------------------------------------

class APIServerGone(ConnectionError):
    """The API server closed the outputs socket (it died, or stopped without stopping us)."""


class EngineCoreProc:
    """EngineCore in its own process (seed steps 9, 14): an input thread decodes the
    requests that come over ZeroMQ into a queue; the main thread runs the busy loop
    (drain the queue, step, send outputs and scheduler stats).

    Outputs go straight from this loop into a Unix stream socket the API server's event
    loop reads (length-prefixed frames, messages.frame), not through ZeroMQ: a ZeroMQ send
    hands every message to its I/O thread, which wakes to write it, and the receiver's I/O
    thread wakes again to hand it to the event loop. At one output message per step those
    two extra thread wake-ups a token land on the cores the model's OpenMP threads run on."""

    def __init__(self, args, engine_index: int, input_address: str, output_address: str) -> None:
        import zmq

        self.engine_index = engine_index
        self.ctx = zmq.Context()
        self.output_socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.output_socket.connect(output_address)
        self.encoder = msgspec.msgpack.Encoder()
        self.input_queue: queue.Queue = queue.Queue()
        self._stats_dirty = True  # a request came or went: the frontend's counts need the engine's
        if args.enable_tracing:
            tracer.enable(args.trace_layers)
        start_cpu_kernel_build()
        if args.kv_transfer_config is not None:  # each data-parallel replica's side channel has its port
            from lane.config import KVTransferConfig

            ktc = asdict(KVTransferConfig.parse(args.kv_transfer_config))
            ktc["kv_connector_extra_config"] = {**ktc["kv_connector_extra_config"], "dp_rank": engine_index}
            args = replace(args, kv_transfer_config=ktc)
        config = args.create_engine_config()
        self.core = EngineCore(config, own_process=True)
        kv = self.core.kv_cache_config
        # (mapped before READY: the API server unlinks the segment once every engine is ready)
        self.dp = None  # data-parallel attention: the replicas' lock-step (dp_coordinator.py)
        if config.parallel_config.data_parallel_expert:
            from lane.engine.dp_coordinator import DPCoordinator

            pc = config.parallel_config
            self.dp = DPCoordinator(args.data_parallel_sync_path, pc.data_parallel_size, engine_index,
                                    config.scheduler_config.max_num_seqs, pc.worker_timeout)
            self.core.dp_stats = self.dp.stats
        threading.Thread(target=self._read_inputs, args=(input_address,), daemon=True,
                         name="EngineCoreInput").start()
        self._send(EngineCoreOutputType.READY, EngineReady(
            engine_index, os.getpid(), kv.num_blocks[0] - 1, kv.block_size, self.core.kv_cache_bytes,
            config.cache_config.enable_prefix_caching, self.core.executor.threads,
            tracer.drain() if tracer.enabled else None,
            skipped_steps(config.model_config.hf_config, config.parallel_config.tensor_parallel_size,
                          config.speculative_config is not None, config.kv_transfer_config is not None,
                          eplb=config.parallel_config.enable_eplb,
                          sequence_parallel=config.parallel_config.enable_sequence_parallel,
                          dsa_cp=config.parallel_config.enable_dsa_cp)
            if tracer.enabled else None,
            occasional_steps(config.parallel_config.eplb_config if config.parallel_config.enable_eplb else None,
                             config.kv_transfer_config) if tracer.enabled else None))
        self._last_stats: SchedulerStats | None = None
        # Fault injection, for tests only: LANE_FAULT_INJECT=step:N makes this process's N-th
        # step raise (a ValueError, the kind a bad configuration also raises at start-up), so
        # the handling of a runtime error while serving is tested on a real server.
        fault = os.environ.get("LANE_FAULT_INJECT", "")
        self._fail_at_step = int(fault.removeprefix("step:")) if fault.startswith("step:") else 0
        self._num_steps = 0

    def _read_inputs(self, address: str) -> None:
        import zmq

        sock = self.ctx.socket(zmq.PULL)
        sock.connect(address)
        add_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        abort_decoder = msgspec.msgpack.Decoder(list[str])
        while True:
            kind, payload = sock.recv_multipart(copy=False)
            received = time.monotonic()
            kind = EngineCoreRequestType(kind.bytes)
            decoder = add_decoder if kind is EngineCoreRequestType.ADD else abort_decoder
            self.input_queue.put((kind, decoder.decode(payload.buffer), received))

    def _send(self, kind: EngineCoreOutputType, obj) -> None:
        self._send_payload(kind, self.encoder.encode(obj))

    def _send_payload(self, kind: EngineCoreOutputType, payload: bytes) -> None:
        try:  # blocks only while the API server lets its socket buffer fill (as ZeroMQ's HWM did)
            self.output_socket.sendall(frame(kind, payload))
        except (BrokenPipeError, ConnectionResetError):
            raise APIServerGone("the API server closed the outputs socket") from None

    def report_error(self, e: BaseException) -> None:
        """Tell the frontend the error this engine stops on (its requests' 500 bodies carry it)."""
        try:
            self._send(EngineCoreOutputType.ERROR, [self.engine_index, f"{type(e).__name__}: {e}"])
        except Exception:  # noqa: BLE001 - exiting anyway; the frontend still sees the exit code
            pass

    def _handle(self, kind: EngineCoreRequestType, payload, received: float) -> None:
        self._stats_dirty = True
        if kind is EngineCoreRequestType.ADD:
            self.core.add_request(payload)
            if tracer.enabled:  # step 14: from the socket into the waiting queue
                tracer.record(Step.ENGINE_ADD_REQUEST, received, time.monotonic(), [payload.request_id],
                              prompt_tokens=len(payload.prompt_token_ids),
                              waiting=len(self.core.scheduler.waiting))
        else:
            self.core.abort_requests(payload)

    def run_busy_loop(self) -> None:
        while True:
            self.run_once()

    def run_once(self) -> None:
        """One turn of the loop: take the requests that came (waiting for one when idle), step,
        publish the outputs."""
        if self.dp is not None:
            return self._run_lockstep_once()
        if not self.core.has_unfinished_requests():  # idle: block on the queue
            self._handle(*self.input_queue.get())
        while not self.input_queue.empty():
            self._handle(*self.input_queue.get_nowait())
        self._num_steps += 1
        if self._num_steps == self._fail_at_step:
            raise ValueError(f"fault injected at step {self._num_steps} (LANE_FAULT_INJECT)")
        self._publish(self.core.step())
        if tracer.enabled and tracer.spans:
            self._send(EngineCoreOutputType.SPANS, tracer.drain())

    def _run_lockstep_once(self) -> None:
        """run_once with the other replicas (data-parallel attention): agree whether anyone has
        work and whether anyone is at its cap, then all step (a dummy batch where nothing is
        scheduled) or all wait (polling, so a request at any replica wakes every one)."""
        core, sched = self.core, self.core.scheduler
        if not core.has_unfinished_requests():
            try:
                self._handle(*self.input_queue.get(timeout=self.dp.poll_s))
            except queue.Empty:
                pass
        while not self.input_queue.empty():
            self._handle(*self.input_queue.get_nowait())
        rnd = self.dp.sync(core.has_unfinished_requests(), len(sched.running), len(sched.waiting),
                           core.last_scheduled_tokens)
        core.last_scheduled_tokens = 0
        if not rnd.any_work:
            if self._stats_dirty:
                self._publish([])
            return
        sched.admission_frozen = rnd.frozen
        core.dp_attrs = dict(dp_rank=self.engine_index, dp_running="/".join(map(str, rnd.running)),
                             dp_waiting="/".join(map(str, rnd.waiting)), dp_admission_frozen=rnd.frozen)
        self._num_steps += 1
        if self._num_steps == self._fail_at_step:
            raise ValueError(f"fault injected at step {self._num_steps} (LANE_FAULT_INJECT)")
        self._publish(core.step())
        if tracer.enabled and tracer.spans:
            self._send(EngineCoreOutputType.SPANS, tracer.drain())

    def _publish(self, outputs: list[EngineCoreOutput]) -> None:
        """A step's outputs to the frontend, with the scheduler's counts when they changed, or when
        a request came or went since the last ones sent (the frontend's balancer bumps its own
        counts at each send and waits for the engine's to overwrite them). Unchanged counts are
        not sent: at one message a token, they cost the API server a dozen Prometheus updates
        a token for nothing."""
        stats = self.core.make_stats()
        changed = self._stats_dirty or stats != self._last_stats
        if not (outputs or changed):
            return
        t_send = time.monotonic()
        payload = self.encoder.encode(EngineCoreOutputs(self.engine_index, outputs, stats if changed else None))
        t_encoded = time.monotonic()
        self._send_payload(EngineCoreOutputType.OUTPUTS, payload)
        if changed:
            self._last_stats, self._stats_dirty = stats, False
        if self.core.step_log is not None:
            self.core.step_log.send_s = time.monotonic() - t_send
        if tracer.enabled and outputs:  # step 37: until the message is handed to the socket
            tracer.record(Step.ENGINE_OUTPUT, t_send, t_encoded, [o.request_id for o in outputs],
                          outputs=len(outputs), bytes=len(payload))


def watch_parent(parent_pid: int, engine_index: int, interval_s: float = 0.5) -> None:
    """End this process (os._exit: no clean-up that could block) once the API server that
    spawned it is gone without stopping it (SIGKILL, OOM). Nobody would read its outputs, a
    send into a socket without a peer blocks forever, and the model and KV pool stay held.
    A daemon thread, so it acts whatever the main thread is in: idle, a forward, a send."""
    def watch() -> None:
        while os.getppid() == parent_pid:  # an orphan is re-parented: its parent pid changes
            time.sleep(interval_s)
        logger.warning("API server (pid %d) is gone; engine core %d exits", parent_pid, engine_index)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="ParentWatch").start()


def run_engine_core(args, engine_index: int, input_address: str, output_address: str,
                    cpu_ids: list[int] | None = None) -> None:
    """Entry point of an engine-core process (spawned by the frontend's core client)."""
    configure_process_logging(f"EngineCore_DP{engine_index}")
    parent = os.getppid()
    watch_parent(parent, engine_index)  # from the start: loading can take long too
    # SIGTERM (from the frontend's shutdown or a user) ends the loop through SystemExit
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the frontend, which stops us
    if cpu_ids:
        os.sched_setaffinity(0, cpu_ids)
    # spawned as a daemon (it must not outlive the frontend), yet it starts the worker processes
    # of its ranks: multiprocessing refuses children of a daemon unless told otherwise
    import multiprocessing

    multiprocessing.current_process().daemon = False
    try:
        proc = EngineCoreProc(args, engine_index, input_address, output_address)
    except SystemExit:
        return
    except (ValueError, FileNotFoundError) as e:  # a configuration the engine cannot run
        logger.error("Engine core %d cannot start: %s", engine_index, e)
        sys.exit(1)
    except BaseException:
        logger.exception("Engine core %d cannot start", engine_index)
        sys.exit(1)
    try:
        proc.run_busy_loop()
    except SystemExit:
        pass
    except APIServerGone:  # as watch_parent: nobody reads our outputs any more
        logger.warning("API server (pid %d) is gone; engine core %d exits (its outputs socket closed)",
                       parent, engine_index)
        proc.core.shutdown()
        sys.exit(1)
    except BaseException as e:  # the frontend fails its requests with the error; /health 503
        logger.exception("Engine core %d stopped on a runtime error while serving", engine_index)
        proc.report_error(e)
        proc.core.shutdown()
        sys.exit(1)
    proc.core.shutdown()

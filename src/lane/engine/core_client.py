"""The frontend's handle on its engine-core processes (vLLM's AsyncMPClient /
DPLBAsyncMPClient; seed steps 9, 13, 14, 37, 57).

One process per data-parallel replica, spawned here. Requests go out on one
ZeroMQ PUSH socket per engine; every engine pushes its outputs (with scheduler
stats) into one PULL socket. Messages are two frames: a type byte and a msgspec
msgpack payload. A watchdog notices an engine process that died.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import shutil
import time
from typing import Callable

import msgspec
import zmq
import zmq.asyncio

from lane.config import EngineArgs
from lane.engine.messages import (EngineCoreOutputs, EngineCoreOutputType, EngineCoreRequest,
                                  EngineCoreRequestType, EngineReady)
from lane.engine.dp_balancer import DPLoadBalancer
from lane.ipc_paths import make_ipc_dir
from lane.platform import available_cpus, disjoint_cpu_sets
from lane.tracing import Span

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """An engine-core process is gone; its requests cannot finish."""


class EngineBusyError(RuntimeError):
    """An engine's input queue is full (ZeroMQ's high-water mark): it takes nothing more now."""


def split_cpus(num_engines: int) -> list[list[int] | None]:
    """Disjoint CPU sets per replica, so data-parallel engines do not fight over cores."""
    sets = disjoint_cpu_sets(num_engines) if num_engines > 1 else None
    return sets or [None] * num_engines


def _engine_core_main(*args) -> None:
    """The spawned process's entry: the engine module (and the model stack it imports)
    loads there, never in the API server."""
    from lane.engine.core import run_engine_core

    run_engine_core(*args)


class AsyncMPClient:
    def __init__(self, args: EngineArgs, data_parallel_size: int,
                 on_outputs: Callable[[EngineCoreOutputs], None],
                 on_engine_dead: Callable[[int, int | None], None],
                 on_spans: Callable[[list[Span]], None] | None = None,
                 max_num_waiting_requests: int | None = None) -> None:
        if data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {data_parallel_size}")
        self.args = args
        self.num_engines = data_parallel_size
        self.on_outputs = on_outputs
        self.on_engine_dead = on_engine_dead
        self.on_spans = on_spans
        self.balancer = DPLoadBalancer(data_parallel_size, max_num_waiting_requests)
        self.ready: list[EngineReady] = []
        self.procs: list[multiprocessing.Process] = []
        self.dead: dict[int, int | None] = {}  # engine index -> exit code (None: not exited yet)
        self.errors: dict[int, str] = {}  # engine index -> the runtime error it stopped on
        self._ipc_dir = make_ipc_dir("ipc")  # removes what a killed server left
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self._encoder = msgspec.msgpack.Encoder()
        self._tasks: list[asyncio.Task] = []
        self._closed = False
        self._pending_aborts: dict[int, list[str]] = {}  # engine index -> ids not yet sent

    # -- start-up --------------------------------------------------------------
    def launch(self) -> None:
        """Bind the sockets and spawn the engine processes; start() waits for them. Called
        first thing, so the engines import and load while the frontend sets itself up."""
        out_addr = f"ipc://{self._ipc_dir}/outputs"
        self.output_socket = self._async_ctx.socket(zmq.PULL)
        self.output_socket.bind(out_addr)
        self.input_sockets = []
        cpu_sets = split_cpus(self.num_engines)
        threads = self.args.threads
        if threads is None and self.num_engines > 1 and self.args.tensor_parallel_size == 1:
            threads = max(1, available_cpus() // self.num_engines)
        ctx = multiprocessing.get_context("spawn")
        for i in range(self.num_engines):
            in_addr = f"ipc://{self._ipc_dir}/input-{i}"
            sock = self._sync_ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(in_addr)
            self.input_sockets.append(sock)
            args = self._args_for(threads)
            proc = ctx.Process(target=_engine_core_main, name=f"EngineCore_DP{i}",
                               args=(args, i, in_addr, out_addr, cpu_sets[i]), daemon=True)
            proc.start()
            self.procs.append(proc)

    async def start(self, timeout_s: float = 600.0) -> None:
        if not self.procs:
            self.launch()
        await self._wait_ready(timeout_s)
        self._tasks = [asyncio.create_task(self._output_loop(), name="engine-outputs"),
                       asyncio.create_task(self._watchdog(), name="engine-watchdog")]

    def _args_for(self, threads: int | None) -> EngineArgs:
        from dataclasses import replace

        # progress bars of several engines would garble each other
        return replace(self.args, threads=threads, show_progress=self.args.show_progress and self.num_engines == 1)

    async def _wait_ready(self, timeout_s: float) -> None:
        decoder = msgspec.msgpack.Decoder(EngineReady)
        pending = set(range(self.num_engines))
        ready: dict[int, EngineReady] = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            for i in pending:
                code = self.procs[i].exitcode
                if code is not None:
                    self.shutdown()
                    raise RuntimeError(f"engine core {i} failed to start (exit code {code}); "
                                       f"its log is above")
            if time.monotonic() > deadline:
                self.shutdown()
                raise TimeoutError(f"engine cores {sorted(pending)} not ready after {timeout_s:.0f} s")
            if await self.output_socket.poll(500) == 0:
                continue
            kind, payload = await self.output_socket.recv_multipart()
            if kind != EngineCoreOutputType.READY.value:
                continue
            msg = decoder.decode(payload)
            ready[msg.engine_index] = msg
            pending.discard(msg.engine_index)
        self.ready = [ready[i] for i in range(self.num_engines)]

    # -- running ---------------------------------------------------------------
    async def _output_loop(self) -> None:
        decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        span_decoder = msgspec.msgpack.Decoder(list[Span])
        while True:
            kind, payload = await self.output_socket.recv_multipart(copy=False)
            if kind.bytes == EngineCoreOutputType.SPANS.value:
                if self.on_spans is not None:
                    self.on_spans(span_decoder.decode(payload.buffer))
                continue
            if kind.bytes == EngineCoreOutputType.ERROR.value:  # sent just before it exits
                i, text = msgspec.msgpack.decode(payload.buffer)
                self.errors[i] = text
                logger.error("Engine core %d stopped on a runtime error: %s", i, text)
                self._mark_dead(i, None)
                continue
            if kind.bytes != EngineCoreOutputType.OUTPUTS.value:
                continue
            outs = decoder.decode(payload.buffer)
            stats = outs.scheduler_stats
            if stats is not None:
                self.balancer.update(outs.engine_index, stats.num_waiting_reqs, stats.num_running_reqs)
            try:
                self.on_outputs(outs)
            except Exception:
                logger.exception("Error while processing engine outputs")

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            for i in list(self._pending_aborts):
                self._flush_aborts(i)
            for i, proc in enumerate(self.procs):
                if proc.exitcode is not None and self.dead.get(i) is None:
                    logger.error("Engine core %d (pid %d) died with exit code %s", i, proc.pid, proc.exitcode)
                    self._mark_dead(i, proc.exitcode)

    def _mark_dead(self, engine_index: int, exitcode: int | None) -> None:
        """An engine that stopped (its error message came) or exited: its requests fail once."""
        first = engine_index not in self.dead
        self.dead[engine_index] = exitcode
        if first:
            self.balancer.mark_dead(engine_index)
            self.on_engine_dead(engine_index, exitcode)

    def choose_engine(self, data_parallel_rank: int | None, num_requests: int) -> int:
        return self.balancer.choose(data_parallel_rank, num_requests)

    def _send(self, engine_index: int, kind: EngineCoreRequestType, payload) -> None:
        if engine_index in self.dead:
            raise EngineDeadError(f"engine core {engine_index} is not running")
        try:  # never blocks the event loop: a full queue is an error the caller reports
            self.input_sockets[engine_index].send_multipart((kind.value, self._encoder.encode(payload)),
                                                            flags=zmq.NOBLOCK)
        except zmq.Again:
            raise EngineBusyError(f"engine core {engine_index} takes no requests now: its input queue "
                                  f"is full") from None

    def add_request(self, engine_index: int, request: EngineCoreRequest) -> None:
        self._send(engine_index, EngineCoreRequestType.ADD, request)

    def abort_requests(self, engine_index: int, request_ids: list[str]) -> None:
        """Aborts must reach the engine, or it computes the requests for nobody: ids that
        cannot go now (a full queue) are kept, and sent after those adds by the watchdog."""
        if request_ids and engine_index not in self.dead:
            self._pending_aborts.setdefault(engine_index, []).extend(request_ids)
            self._flush_aborts(engine_index)

    def _flush_aborts(self, engine_index: int) -> None:
        ids = self._pending_aborts.pop(engine_index, [])
        if not ids or engine_index in self.dead:
            return
        try:
            self._send(engine_index, EngineCoreRequestType.ABORT, ids)
        except EngineBusyError:
            self._pending_aborts[engine_index] = ids

    @property
    def all_alive(self) -> bool:
        return not self.dead and all(p.exitcode is None for p in self.procs)

    # -- shutdown --------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for t in self._tasks:
            t.cancel()
        for p in self.procs:
            if p.exitcode is None:
                p.terminate()  # SIGTERM: the engine loop exits through SystemExit
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            p.join(max(deadline - time.monotonic(), 0.0))
            if p.exitcode is None:
                p.kill()
                p.join(1.0)
        for s in getattr(self, "input_sockets", []):
            s.close(0)
        if hasattr(self, "output_socket"):
            self.output_socket.close(0)
        self._sync_ctx.term()
        self._async_ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

"""The frontend's handle on its engine-core processes (vLLM's AsyncMPClient /
DPLBAsyncMPClient; seed steps 9, 13, 14, 37, 57).

One process per data-parallel replica, spawned here. Requests go out on one
ZeroMQ PUSH socket per engine (two frames: a type byte and a msgspec msgpack
payload). Every engine connects to one Unix stream socket and writes its outputs
(with scheduler stats) there as length-prefixed frames (messages.frame), which the
event loop reads in a reader callback: no ZeroMQ I/O thread between the engine's
loop and this one, no future per message. A watchdog notices an engine process
that died.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import socket
import time
from typing import Callable

import msgspec
import zmq

from lane.config import EngineArgs
from lane.engine.messages import (EngineCoreOutputs, EngineCoreOutputType, EngineCoreRequest,
                                  EngineCoreRequestType, EngineReady, FrameReader)
from lane.engine.dp_balancer import DPLoadBalancer
from lane.ipc_paths import make_ipc_dir
from lane.platform import available_cpus, disjoint_cpu_sets, parse_cpu_list
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


def frontend_cpus(engine_cpu_sets: list[list[int] | None], allowed: list[int],
                  tensor_parallel_size: int = 1) -> list[int] | None:
    """The CPUs the API server's threads are kept on (LANE_API_SERVER_BIND=auto, the default):
    every CPU this process may use but those the engines' main threads are pinned to, None to
    leave them where they are.

    A one-rank engine pins OpenMP thread i to its i-th CPU; thread 0 is the engine loop itself,
    which runs the step's serial Python (scheduling, inputs, sampling, outputs) while the others
    spin-wait. The API server wakes at every token: left to the OS, it is often put on the CPU of
    the thread that woke it, the engine loop's, and stalls the step; on another engine thread's
    CPU it only takes a spinning thread's turn, outside the kernels. None when no CPU is left
    (one per engine), with LANE_API_SERVER_BIND=nobind, when the engines' threads are not bound
    (LANE_CPU_OMP_THREADS_BIND=nobind), or with tensor parallelism (the ranks are other processes)."""
    if os.environ.get("LANE_API_SERVER_BIND", "auto").strip() == "nobind" or tensor_parallel_size != 1:
        return None
    spec = os.environ.get("LANE_CPU_OMP_THREADS_BIND", "auto").strip()
    if spec == "nobind":
        return None
    mains = set()
    for cpus in engine_cpu_sets:
        if spec != "auto":
            try:
                mains.add(parse_cpu_list(spec)[0])
            except (ValueError, IndexError):  # the engine refuses it at start, naming it
                return None
        else:
            mains.add(sorted(cpus or allowed)[0])
    rest = [c for c in allowed if c not in mains]
    return rest or None


def bind_this_process(cpus: list[int]) -> None:
    """Every thread of this process (and those it starts later) on ``cpus``."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that just ended
            pass


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
        self._encoder = msgspec.msgpack.Encoder()
        self._tasks: list[asyncio.Task] = []
        self._conns: dict[int, tuple[socket.socket, FrameReader]] = {}  # engine index -> its outputs
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._spans_decoder = msgspec.msgpack.Decoder(list[Span])
        self._closed = False
        self._pending_aborts: dict[int, list[str]] = {}  # engine index -> ids not yet sent
        self._dp_segment: str | None = None  # the engines' lock-step segment, until they all attached

    # -- start-up --------------------------------------------------------------
    def launch(self) -> None:
        """Bind the sockets and spawn the engine processes; start() waits for them. Called
        first thing, so the engines import and load while the frontend sets itself up."""
        out_addr = os.path.join(self._ipc_dir, "outputs.sock")
        self.output_socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.output_socket.bind(out_addr)
        self.output_socket.listen(self.num_engines + 4)
        self.output_socket.setblocking(False)
        self.input_sockets = []
        cpu_sets = split_cpus(self.num_engines)
        threads = self.args.threads
        if threads is None and self.num_engines > 1 and self.args.tensor_parallel_size == 1:
            threads = max(1, available_cpus() // self.num_engines)
        ctx = multiprocessing.get_context("spawn")
        lockstep = {}
        if self.num_engines > 1 and self.args.enable_expert_parallel:  # data-parallel attention, wide EP
            from lane.engine.dp_coordinator import create_segment

            with socket.socket() as s:  # where every replica's model ranks meet
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            self._dp_segment = create_segment(self.num_engines)
            lockstep = dict(data_parallel_master_port=port, data_parallel_sync_path=self._dp_segment)
        for i in range(self.num_engines):
            in_addr = f"ipc://{self._ipc_dir}/input-{i}"
            sock = self._sync_ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(in_addr)
            self.input_sockets.append(sock)
            args = self._args_for(threads, i, lockstep)
            proc = ctx.Process(target=_engine_core_main, name=f"EngineCore_DP{i}",
                               args=(args, i, in_addr, out_addr, cpu_sets[i]), daemon=True)
            proc.start()
            self.procs.append(proc)
        # after the spawns: the engines start with every CPU this process has
        allowed = sorted(os.sched_getaffinity(0))
        bound = frontend_cpus(cpu_sets, allowed, self.args.tensor_parallel_size)
        if bound is not None and bound != allowed and os.path.isdir("/proc/self/task"):
            bind_this_process(bound)
            logger.info("API server threads on CPUs %s, off the engine loop's (LANE_API_SERVER_BIND=nobind "
                        "leaves them to the OS)", bound)

    async def start(self, timeout_s: float = 600.0) -> None:
        if not self.procs:
            self.launch()
        await self._wait_ready(timeout_s)
        self._loop = asyncio.get_running_loop()
        for i, (conn, _) in self._conns.items():
            self._loop.add_reader(conn.fileno(), self._on_readable, i)
        self._tasks = [asyncio.create_task(self._watchdog(), name="engine-watchdog")]

    def _args_for(self, threads: int | None, index: int = 0, lockstep: dict | None = None) -> EngineArgs:
        from dataclasses import replace

        # progress bars of several engines would garble each other
        return replace(self.args, threads=threads, show_progress=self.args.show_progress and self.num_engines == 1,
                       data_parallel_size=self.num_engines, data_parallel_rank=index, **(lockstep or {}))

    async def _wait_ready(self, timeout_s: float) -> None:
        """Accept each engine's outputs connection and read its READY message (start-up takes
        seconds: polled every 20 ms)."""
        decoder = msgspec.msgpack.Decoder(EngineReady)
        pending = set(range(self.num_engines))
        ready: dict[int, EngineReady] = {}
        unknown: list[tuple[socket.socket, FrameReader]] = []  # connected, READY not read yet
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
            while True:
                try:
                    conn, _ = self.output_socket.accept()
                except (BlockingIOError, InterruptedError):
                    break
                conn.setblocking(False)
                unknown.append((conn, FrameReader()))
            for conn, reader in list(unknown):
                try:
                    data = conn.recv(1 << 20)
                except (BlockingIOError, InterruptedError):
                    continue
                if not data:  # it closed before READY: its exit code says why, next round
                    unknown.remove((conn, reader))
                    conn.close()
                    continue
                for kind, payload in reader.feed(data):
                    if kind == EngineCoreOutputType.READY.value:
                        msg = decoder.decode(payload)
                        ready[msg.engine_index] = msg
                        pending.discard(msg.engine_index)
                        self._conns[msg.engine_index] = (conn, reader)
                        unknown.remove((conn, reader))
            if pending:
                await asyncio.sleep(0.02)
        self.ready = [ready[i] for i in range(self.num_engines)]
        self._drop_dp_segment()  # every engine has mapped it

    def _drop_dp_segment(self) -> None:
        if self._dp_segment is not None:
            try:
                os.unlink(self._dp_segment)
            except FileNotFoundError:
                pass
            self._dp_segment = None

    # -- running ---------------------------------------------------------------
    def _on_readable(self, engine_index: int) -> None:
        """The event loop's reader callback for one engine's outputs socket: what arrived,
        handled now (on_outputs is synchronous; a message costs one loop iteration)."""
        conn, reader = self._conns[engine_index]
        try:
            data = conn.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the engine closed it (exited): the watchdog reports its exit code
            self._loop.remove_reader(conn.fileno())
            return
        for kind, payload in reader.feed(data):
            try:
                self._dispatch(kind, payload)
            except Exception:
                logger.exception("Error while processing engine outputs")

    def _dispatch(self, kind: bytes, payload: memoryview) -> None:
        if kind == EngineCoreOutputType.OUTPUTS.value:
            outs = self._outputs_decoder.decode(payload)
            stats = outs.scheduler_stats
            if stats is not None:
                self.balancer.update(outs.engine_index, stats.num_waiting_reqs, stats.num_running_reqs)
            self.on_outputs(outs)
        elif kind == EngineCoreOutputType.SPANS.value:
            if self.on_spans is not None:
                self.on_spans(self._spans_decoder.decode(payload))
        elif kind == EngineCoreOutputType.ERROR.value:  # sent just before it exits
            i, text = msgspec.msgpack.decode(payload)
            self.errors[i] = text
            logger.error("Engine core %d stopped on a runtime error: %s", i, text)
            self._mark_dead(i, None)

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
        self._drop_dp_segment()
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
        for conn, _ in self._conns.values():
            if self._loop is not None and not self._loop.is_closed():
                try:
                    self._loop.remove_reader(conn.fileno())
                except (ValueError, RuntimeError):  # already closed / another thread's loop
                    pass
            conn.close()
        if hasattr(self, "output_socket"):
            self.output_socket.close()
        self._sync_ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

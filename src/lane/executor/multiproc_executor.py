"""One worker process per rank (vLLM's ``MultiprocExecutor`` / ``WorkerProc``).

The engine broadcasts every call (``SchedulerOutput``s included) through a
``MessageQueue``: shared memory to the ranks on its machine, ZeroMQ to ranks on others.
Replies come back on one ZeroMQ PULL socket: rank 0's output each step (every rank's when
tracing, with their spans), and any rank's error. Ports: ``--master-port`` is
torch.distributed's rendezvous, +1 the broadcast, +2 the replies from other machines.

Each local rank is spawned pinned to its share of the CPUs, with one thread per CPU of it
(more ranks than CPUs: one thread each, CPUs shared, with a warning). A worker that exits,
fails, or makes no progress for ``--worker-timeout`` seconds fails the engine: the waiting
call raises ``WorkerError`` (and an engine-core process ends, so /health turns 503). Workers
end when the engine stops them, or when their parent process is gone.
"""
from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import pickle
import queue
import shutil
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import replace
from typing import Callable

import zmq

from lane.config import EngineConfig
from lane.distributed.rpc_auth import SECRET_ENV, AuthError, RpcAuth, resolve_rpc_secret
from lane.distributed.shm_broadcast import HEARTBEAT_S, MessageQueue, MessageReader, QueueHandle
from lane.executor.abstract import Executor, WorkerError
from lane.ipc_paths import make_ipc_dir
from lane.platform import disjoint_cpu_sets
from lane.tracing import tracer

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 900.0  # loading a large checkpoint on a slow disk
WORKER_HEARTBEAT_S = 1.0  # a rank on another machine beats this often ...
NODE_LOST_S = 3.5  # ... and is lost after this long without a word
HEARTBEAT_SENDER = 1 << 31  # a rank's heartbeat socket signs as its rank with this bit (its own counter)
AUTH_REFUSED_EXIT = 3  # a worker that found the engine's secret is not its own


def rank_cpu_sets(num_ranks: int) -> list[list[int]]:
    """Disjoint CPU sets, one per local rank; with fewer CPUs than ranks, CPUs are shared."""
    sets = disjoint_cpu_sets(num_ranks)
    if sets is None:
        cpus = sorted(os.sched_getaffinity(0))
        logger.warning("%d ranks on %d CPUs: each rank runs one thread and CPUs are shared (slow; "
                       "for correctness checks, not speed)", num_ranks, len(cpus))
        return [[cpus[i % len(cpus)]] for i in range(num_ranks)]
    return sets


def _worker_main(*args) -> None:
    WorkerProc.run(*args)


class WorkerProc:
    """A rank's process: builds its Worker, then runs every broadcast call."""

    @staticmethod
    def run(engine_args, rank: int, ranks_on_node: int, local_index: int | None, handle: QueueHandle,
            reply_address: str, cpu_ids: list[int] | None, threads: int | None, trace: tuple[bool, bool],
            parent_pid: int, auth_key: bytes) -> None:
        from lane.logger import configure_process_logging

        configure_process_logging(f"Worker_TP{rank}")
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the frontend, which stops us
        _watch_parent(parent_pid, rank)
        if cpu_ids:
            os.sched_setaffinity(0, cpu_ids)
        if trace[0]:
            tracer.enable(trace[1])
        auth = RpcAuth(auth_key, rank)
        ctx = zmq.Context()
        reply = ctx.socket(zmq.PUSH)
        reply.setsockopt(zmq.LINGER, 2000)
        reply.connect(reply_address)
        remote = local_index is None
        if remote:  # the engine on another machine hears from us while we load, too
            _start_heartbeat(ctx, reply_address, auth.for_sender(rank | HEARTBEAT_SENDER))
        reader = MessageReader(handle, local_index, None if not remote else RpcAuth(auth_key))

        def send(kind: str, payload) -> None:
            reply.send(auth.seal(pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)))

        try:
            reader.wait_for_writer(READY_TIMEOUT_S)  # a wrong secret is refused here, before loading
        except AuthError:
            logger.error("worker rank %d: the engine at %s signs with another RPC secret than this node's "
                         "(LANE_RPC_SECRET / --rpc-secret-file must be node 0's); refusing it", rank, handle.remote_address)
            sys.exit(AUTH_REFUSED_EXIT)
        # Fault injection, for tests only: LANE_FAULT_INJECT=worker_hang:R:N makes rank R stop
        # answering at its N-th step (the engine's --worker-timeout must end the wait);
        # worker_start_fail:R makes rank R fail to start
        fault = os.environ.get("LANE_FAULT_INJECT", "").split(":")
        try:
            if fault[0] == "worker_start_fail" and int(fault[1]) == rank:
                raise RuntimeError("injected start-up failure (LANE_FAULT_INJECT)")
            from lane.worker.worker import Worker

            config = engine_args.create_engine_config()
            config.threads = threads
            worker = Worker(config, own_process=True, rank=rank, ranks_on_node=ranks_on_node)
        except BaseException as e:
            logger.exception("Worker rank %d cannot start", rank)
            send("error", f"{type(e).__name__}: {e}")
            time.sleep(0.5)
            sys.exit(1)
        send("ready", (os.getpid(), socket.gethostname(), worker.threads, tracer.drain() if tracer.enabled else []))
        hang_at = int(fault[2]) if fault[0] == "worker_hang" and int(fault[1]) == rank else 0
        steps = 0
        while True:
            # on another machine: no heartbeat for a while means the engine is gone
            msg = reader.dequeue(None if not remote else 5 * HEARTBEAT_S)
            if msg is None:
                logger.warning("worker rank %d: no word from the engine for %.0f s; exiting", rank, 5 * HEARTBEAT_S)
                break
            method, args, reply_rank = msg
            if method == "shutdown":
                break
            steps += method == "execute_model"
            if hang_at and steps == hang_at:
                time.sleep(3600)
            try:
                result = getattr(worker, method)(*args)
            except BaseException as e:
                logger.exception("Worker rank %d failed in %s", rank, method)
                send("error", f"{type(e).__name__} in {method}: {e}\n{traceback.format_exc(limit=4)}")
                continue
            if reply_rank is None or reply_rank == rank:
                send("ok", (result, tracer.drain() if tracer.enabled else []))
        reader.close()
        reply.close()
        ctx.term()


def _start_heartbeat(ctx: zmq.Context, address: str, auth: RpcAuth) -> None:
    """A rank on another machine tells the engine it lives (its own socket, its own thread)."""
    def beat() -> None:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 4)  # an engine not reading yet needs no backlog of them
        sock.connect(address)
        while True:
            try:
                sock.send(auth.seal(b""), zmq.NOBLOCK)
            except zmq.Again:
                pass
            except zmq.ZMQError:  # the context is ending: the worker exits
                break
            time.sleep(WORKER_HEARTBEAT_S)
        sock.close()

    threading.Thread(target=beat, daemon=True, name="WorkerHeartbeat").start()


def _watch_parent(parent_pid: int, rank: int, interval_s: float = 0.5) -> None:
    """End this worker once the process that started it is gone (SIGKILL, OOM): nobody would
    send it work, and its memory stays held."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        logger.warning("parent (pid %d) is gone; worker rank %d exits", parent_pid, rank)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="ParentWatch").start()


def spawn_workers(engine_args, ranks: list[int], ranks_on_node: int, local: bool, handle: QueueHandle,
                  reply_address: str, threads: int | None, auth_key: bytes) -> list[multiprocessing.Process]:
    """Start one process per rank of ``ranks`` on this machine, each pinned to its CPUs (the
    key reaches them through the spawn pipe, never the network)."""
    ctx = multiprocessing.get_context("spawn")
    cpu_sets = rank_cpu_sets(len(ranks))
    procs = []
    for i, rank in enumerate(ranks):
        t = threads or len(cpu_sets[i])
        proc = ctx.Process(target=_worker_main, name=f"Worker_TP{rank}", daemon=True,
                           args=(engine_args, rank, ranks_on_node, i if local else None, handle, reply_address,
                                 cpu_sets[i], t, (tracer.enabled, tracer.layer_detail), os.getpid(), auth_key))
        proc.start()
        procs.append(proc)
    return procs


def interface_address(host: str) -> str:
    """The address of --master-addr to listen on (a name resolved: ZeroMQ binds interfaces)."""
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise ValueError(f"--master-addr {host!r} does not resolve: {e}") from None


class ReplyChannel:
    """The engine's end of its workers' replies. One thread owns the socket (ipc from this
    machine's ranks, tcp on --master-addr's interface from other machines' ranks): it checks
    each frame's signature before it unpickles anything (a frame that fails is dropped and
    logged), hands (rank, kind, payload) to ``inbox``, and watches the heartbeats of the
    ranks on other machines: one silent for ``NODE_LOST_S`` is lost (``on_lost`` is told)."""

    def __init__(self, auth: RpcAuth, local_address: str, remote_address: str | None,
                 on_lost: Callable[[str], None]) -> None:
        self.auth, self.on_lost = auth, on_lost
        self.inbox: queue.Queue = queue.Queue()
        self.last_heard: dict[int, float] = {}  # remote ranks, once they have beaten
        self._closing = threading.Event()
        bound: list = []
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(local_address, remote_address, bound, started),
                                        daemon=True, name="WorkerReplies")
        self._thread.start()
        started.wait()
        if bound[0] is not None:
            raise OSError(f"cannot listen for the workers' replies: {bound[0]}")

    def _run(self, local_address: str, remote_address: str | None, bound: list, started: threading.Event) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PULL)
        try:
            sock.bind(local_address)
            if remote_address:
                sock.bind(remote_address)
            bound.append(None)
        except zmq.ZMQError as e:
            bound.append(e)
        started.set()
        lost = False
        while bound[0] is None and not self._closing.is_set():
            if sock.poll(100):
                frame = sock.recv(copy=False)
                try:
                    sender, body = self.auth.open(frame.buffer)
                except AuthError as e:
                    peer = frame.get("Peer-Address") if remote_address else ""
                    self.auth.log_dropped(f"worker replies (from {peer or 'this machine'})", e)
                    continue
                rank = sender & ~HEARTBEAT_SENDER
                if rank in self.last_heard or sender & HEARTBEAT_SENDER:
                    self.last_heard[rank] = time.monotonic()
                if not sender & HEARTBEAT_SENDER:
                    self.inbox.put((rank, *pickle.loads(body)))
            now = time.monotonic()
            silent = sorted(r for r, t in self.last_heard.items() if now - t > NODE_LOST_S)
            if silent and not lost:
                lost = True
                msg = (f"worker rank(s) {silent} on another machine sent no heartbeat for {NODE_LOST_S:.0f} s "
                       f"(the node is lost)")
                self.inbox.put((silent[0], "lost", msg))
                self.on_lost(msg)
        sock.close(linger=0)
        ctx.term()

    def close(self) -> None:
        self._closing.set()
        self._thread.join(2.0)


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, own_process: bool = False) -> None:
        pc = config.parallel_config
        self.config, self.own_process = config, own_process
        self.world = pc.world_size
        local = pc.ranks_per_node
        remote = self.world - local
        self.timeout_s = pc.worker_timeout
        self._closing = False
        self.failed: str | None = None
        self.procs: list[multiprocessing.Process] = []
        self.mq = self.replies = None
        self._ipc_dir = make_ipc_dir("workers")
        try:
            self._start(config, local, remote)
        except BaseException:
            self.shutdown()  # no worker, ring, thread or IPC dir outlives a failed start
            raise
        atexit.register(self.shutdown)  # before multiprocessing's own exit handler kills the workers

    def _start(self, config: EngineConfig, local: int, remote: int) -> None:
        pc = config.parallel_config
        # another machine's ranks: messages signed with the deployment's secret, on the
        # interface of --master-addr only; one machine: a random key, nothing on the network
        host = interface_address(pc.master_addr) if remote else None
        auth = RpcAuth(resolve_rpc_secret(pc.rpc_secret_file, create=True)) if remote else RpcAuth.random()
        self.mq = MessageQueue(local, remote, pc.master_port + 1, host, auth)
        local_reply = f"ipc://{self._ipc_dir}/replies"
        self.replies = ReplyChannel(RpcAuth(auth.key()), local_reply,
                                    f"tcp://{host}:{pc.master_port + 2}" if remote else None, self._node_lost)
        engine_args = config.engine_args
        if pc.nnodes == 1:  # one machine: a free rendezvous port, so replicas and runs never collide
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                engine_args = replace(engine_args, master_port=s.getsockname()[1], master_addr="127.0.0.1")
        self.procs = spawn_workers(engine_args, list(range(local)), local, True, self.mq.handle(),
                                   local_reply, config.threads, auth.key())
        ready = self._gather(set(range(self.world)), READY_TIMEOUT_S, "ready")
        self.mq.wait_for_readers(60.0)
        self.pids = [ready[r][0] for r in range(self.world)]
        self.threads = ready[0][2]
        for r in range(self.world):
            tracer.spans.extend(ready[r][3])
        hosts = sorted({ready[r][1] for r in range(self.world)})
        logger.info("Started %d worker processes (pids %s) on %d machine(s) %s; %d threads each on rank 0's",
                    self.world, ", ".join(map(str, self.pids)), len(hosts), hosts, self.threads)
        threading.Thread(target=self._monitor, daemon=True, name="WorkerMonitor").start()

    # -- the calls -------------------------------------------------------------------
    def collective_rpc(self, method: str, args: tuple = (), unique_reply_rank: int | None = None):
        if self.failed:
            raise WorkerError(self.failed)
        all_reply = unique_reply_rank is None or tracer.enabled  # a tracing run gathers every rank's spans
        self.mq.enqueue((method, args, None if all_reply else unique_reply_rank), self.timeout_s)
        ranks = set(range(self.world)) if all_reply else {unique_reply_rank}
        results = self._gather(ranks, self.timeout_s, "ok", method)
        for r in sorted(results):
            tracer.spans.extend(results[r][1])
        if unique_reply_rank is not None:
            return results[unique_reply_rank][0]
        return [results[r][0] for r in range(self.world)]

    def _gather(self, ranks: set[int], timeout_s: float, kind: str, method: str = "start-up") -> dict:
        pending, results = set(ranks), {}
        deadline = time.monotonic() + timeout_s
        while pending:
            try:
                rank, got, payload = self.replies.inbox.get(timeout=0.1)
            except queue.Empty:
                dead = self._dead_workers()
                if dead or self.failed:
                    self.failed = self.failed or dead
                    raise WorkerError(self.failed) from None
                if time.monotonic() > deadline:
                    self.failed = (f"no reply to {method} from worker rank(s) {sorted(pending)} within "
                                   f"{timeout_s:.0f} s (--worker-timeout)")
                    raise WorkerError(self.failed) from None
                continue
            if got in ("error", "lost"):
                reported = payload if got == "lost" else f"worker rank {rank}: {payload}"
                dead = self._dead_workers(grace_s=0.2)  # a survivor's collective error: name the cause
                self.failed = self.failed or (f"{dead} ({reported})" if dead else reported)
                raise WorkerError(self.failed)
            if got == kind and rank in pending:
                results[rank] = payload
                pending.discard(rank)
        return results

    def _dead_workers(self, grace_s: float = 0.0) -> str:
        """Which local workers have exited, and how ("" while all run). ``grace_s``: how long to
        look again for one, after a rank's error that a peer's death may have caused (the peer's
        exit can be seen a moment after the error it caused)."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = ", ".join(f"worker rank {i} (pid {p.pid}) exited with code {p.exitcode}"
                             for i, p in enumerate(self.procs) if p.exitcode is not None)
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.02)

    def _fail(self, why: str) -> None:
        """A worker gone between calls fails the engine too: in an engine-core process, the
        process ends (its requests fail, /health turns 503); the next call raises anyway."""
        self.failed = self.failed or why
        logger.error("%s: the engine stops", self.failed)
        if self.own_process:
            time.sleep(1.0)  # the main thread, if inside a call, reports it first
            if not self._closing:
                os._exit(1)

    def _node_lost(self, why: str) -> None:
        if not self._closing:
            threading.Thread(target=self._fail, args=(why,), daemon=True).start()

    def _monitor(self) -> None:
        from multiprocessing.connection import wait

        ready = wait([p.sentinel for p in self.procs])
        if self._closing:
            return
        for p in self.procs:
            if p.sentinel in ready:
                p.join(1.0)  # its exit code
        self._fail(self._dead_workers())

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        if self.mq is not None:
            try:
                self.mq.enqueue(("shutdown", (), None), timeout_s=2.0)
            except Exception:
                pass
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                p.terminate()
                p.join(2.0)
            if p.exitcode is None:
                p.kill()
                p.join(2.0)
        if self.mq is not None:
            self.mq.close()
        if self.replies is not None:
            self.replies.close()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)


def run_headless(engine_args) -> int:
    """``lane serve --headless --node-rank N``: this machine's ranks only, reached over ZeroMQ
    from the engine on node 0; returns when they end (the engine stops them, or they fail).
    Without node 0's RPC secret it is refused: ValueError naming the flag."""
    config = engine_args.create_engine_config()
    pc = config.parallel_config
    key = resolve_rpc_secret(pc.rpc_secret_file, create=False)
    per = pc.ranks_per_node
    ranks = list(range(pc.node_rank * per, (pc.node_rank + 1) * per))
    host = pc.master_addr
    handle = QueueHandle(None, None, f"tcp://{host}:{pc.master_port + 1}", 0)
    procs = spawn_workers(engine_args, ranks, per, False, handle, f"tcp://{host}:{pc.master_port + 2}",
                          config.threads, key)
    logger.info("Node %d of %d: worker ranks %s (pids %s), engine at %s:%d", pc.node_rank, pc.nnodes, ranks,
                ", ".join(str(p.pid) for p in procs), host, pc.master_port)

    def stop(*_):
        for p in procs:
            if p.exitcode is None:
                p.terminate()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    code = 0
    for p in procs:
        p.join()
        code = code or (p.exitcode or 0)
    if code == AUTH_REFUSED_EXIT:
        raise ValueError(f"--rpc-secret-file / {SECRET_ENV}: the engine at {host}:{pc.master_port + 1} signs its "
                         f"messages with another secret than this node's; give this node node 0's secret")
    return code

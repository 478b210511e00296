"""Ranks as Ray actors on a running Ray cluster (``ray start --head``, then
``--distributed-executor-backend ray``; ``RAY_ADDRESS`` names the cluster, else Ray's
"auto"). Each call goes to every actor as a Ray task; rank 0's result is the step's output.
The actors join one torch.distributed world (rendezvous at rank 0's node) as the
multiprocess workers do; Ray places them (one CPU each by default,
``LANE_RAY_CPUS_PER_WORKER`` to change), so they may span the cluster's machines.
"""
from __future__ import annotations

import logging
import os
from dataclasses import replace

from lane.config import EngineConfig
from lane.executor.abstract import Executor, WorkerError
from lane.tracing import tracer

logger = logging.getLogger(__name__)


class RayWorkerWrapper:
    """The actor: holds one rank's Worker once ``start`` has run on every rank."""

    def __init__(self, rank: int, threads: int, trace: tuple[bool, bool]) -> None:
        self.rank, self.threads = rank, threads
        if trace[0]:
            tracer.enable(trace[1])
        self.worker = None

    def rendezvous(self) -> tuple[str, int, int]:
        """(this node's address, a free port on it, pid): rank 0's hosts the rendezvous."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port, os.getpid()

    def start(self, engine_args, ranks_on_node: int) -> int:
        from lane.logger import configure_process_logging
        from lane.worker.worker import Worker

        configure_process_logging(f"RayWorker_TP{self.rank}")
        config = engine_args.create_engine_config()
        config.threads = self.threads
        # Ray places the threads: pinning here would put every actor of a node on its first CPUs
        self.worker = Worker(config, own_process=False, rank=self.rank, ranks_on_node=ranks_on_node)
        return self.worker.threads

    def call(self, method: str, args: tuple):
        return getattr(self.worker, method)(*args), (tracer.drain() if tracer.enabled else [])


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        import ray

        pc = config.parallel_config
        self.config = config
        self.world, self.timeout_s = pc.world_size, pc.worker_timeout
        # Ray leaves CUDA_VISIBLE_DEVICES to the actors' own num_gpus (its coming default; quiets its warning)
        os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), log_to_driver=True,
                     runtime_env={"env_vars": {"LANE_LOGGING_LEVEL": os.environ.get("LANE_LOGGING_LEVEL", "INFO")}})
        cpus = float(os.environ.get("LANE_RAY_CPUS_PER_WORKER", "1"))
        actor_cls = ray.remote(num_cpus=cpus)(RayWorkerWrapper)
        trace = (tracer.enabled, tracer.layer_detail)
        self.actors = [actor_cls.options(name=None).remote(r, max(1, int(cpus)), trace) for r in range(self.world)]
        try:
            info = ray.get([a.rendezvous.remote() for a in self.actors], timeout=300)
            addr, port = info[0][0], info[0][1]
            args = replace(config.engine_args, master_addr=addr, master_port=port, nnodes=1, node_rank=0)
            nodes = [i[0] for i in info]
            threads = ray.get([a.start.remote(args, nodes.count(nodes[r])) for r, a in enumerate(self.actors)],
                              timeout=900)
        except Exception as e:
            self.shutdown()
            raise WorkerError(f"Ray workers did not start: {e}") from None
        self.pids = [i[2] for i in info]
        self.threads = threads[0]
        logger.info("Started %d Ray actors (pids %s) on %s; rendezvous at %s:%d", self.world,
                    ", ".join(map(str, self.pids)), sorted(set(nodes)), addr, port)

    def collective_rpc(self, method: str, args: tuple = (), unique_reply_rank: int | None = None):
        import ray

        try:
            results = ray.get([a.call.remote(method, args) for a in self.actors], timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise WorkerError(f"no reply to {method} from the Ray workers within {self.timeout_s:.0f} s "
                              f"(--worker-timeout)") from None
        except ray.exceptions.RayError as e:
            raise WorkerError(f"a Ray worker failed in {method}: {e}") from None
        for _, spans in results:
            tracer.spans.extend(spans)
        if unique_reply_rank is not None:
            return results[unique_reply_rank][0]
        return [r[0] for r in results]

    def shutdown(self) -> None:
        import ray

        for a in getattr(self, "actors", []):
            try:
                ray.kill(a)
            except Exception:
                pass
        self.actors = []

"""One rank, in the engine's own process: calls are plain method calls."""
from __future__ import annotations

from lane.config import EngineConfig
from lane.executor.abstract import Executor
from lane.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig, own_process: bool = False) -> None:
        self.config = config
        self.driver_worker = Worker(config, own_process)
        self.threads = self.driver_worker.threads
        self.pids = []

    def collective_rpc(self, method: str, args: tuple = (), unique_reply_rank: int | None = None):
        result = getattr(self.driver_worker, method)(*args)
        return result if unique_reply_rank is not None else [result]

    def execute_model(self, scheduler_output):
        return self.driver_worker.execute_model(scheduler_output)

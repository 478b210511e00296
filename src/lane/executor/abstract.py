"""The engine's side of its workers (vLLM's ``Executor``): the same calls whatever the
workers are, and the rank whose output counts (rank 0: every rank holds the same tokens)."""
from __future__ import annotations

import functools
import logging

from lane.config import EngineConfig
from lane.core.scheduler_output import SchedulerOutput
from lane.kv_cache_interface import KVCacheConfig
from lane.outputs import ModelRunnerOutput

logger = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """A worker died, failed or stopped answering: the engine cannot go on."""


class Executor:
    driver_worker = None  # the in-process Worker of a one-rank engine (None when workers are processes)
    threads: int = 1
    pids: list[int] = []

    @staticmethod
    def create(config: EngineConfig, own_process: bool = False) -> "Executor":
        backend = config.parallel_config.backend
        if backend == "uni":
            from lane.executor.uniproc_executor import UniProcExecutor

            return UniProcExecutor(config, own_process)
        if backend == "ray":
            from lane.executor.ray_executor import RayExecutor

            return RayExecutor(config)
        from lane.executor.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config, own_process)

    def collective_rpc(self, method: str, args: tuple = (), unique_reply_rank: int | None = None):
        """Call ``method`` on every rank's Worker; returns rank ``unique_reply_rank``'s result, or
        every rank's (a list) when it is None."""
        raise NotImplementedError

    def initialize_kv_cache(self) -> KVCacheConfig:
        config = self.collective_rpc("determine_kv_cache_config", unique_reply_rank=0)
        self.collective_rpc("initialize_kv_cache", (config,))
        return config

    def warmup(self) -> float:
        return max(self.collective_rpc("warmup"))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.config.kv_transfer_config is None:
            return self.collective_rpc("execute_model", (scheduler_output,), unique_reply_rank=0)
        # KV transfers run on every rank at its own pace: a request's transfer is done when every
        # rank has said so (vLLM's KVOutputAggregator)
        outs = self.collective_rpc("execute_model", (scheduler_output,))
        out = outs[0]
        out.kv_connector_output = self._kv_outputs.merge([o.kv_connector_output for o in outs])
        return out

    @functools.cached_property
    def _kv_outputs(self):
        from lane.kv_transfer.base import KVOutputAggregator

        return KVOutputAggregator(self.config.parallel_config.world_size)

    def weight_bytes(self) -> list[int]:
        return self.collective_rpc("weight_bytes")

    def expert_counts(self) -> dict[int, list[int]]:
        """Per MoE layer, tokens each expert served, summed over the expert-parallel ranks (each
        counts its own experts; under tensor parallelism every rank counts them all: rank 0's)."""
        per_rank = self.collective_rpc("expert_counts")
        if self.driver_worker is None and not self.config.parallel_config.enable_expert_parallel:
            per_rank = per_rank[:1]
        total: dict[int, list[int]] = {}
        for counts in per_rank:
            for layer, c in counts.items():
                total[layer] = [a + b for a, b in zip(total.get(layer, [0] * len(c)), c)]
        return total

    def shutdown(self) -> None:
        pass

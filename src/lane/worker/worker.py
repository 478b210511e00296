"""Worker: one per rank (the engine-core process itself at TP=1).

Start-up (seed steps 1, 4, 6, 8): threads and dtype, model load, the KV cache
(specs grouped, pools sized from the memory budget, allocated), warm-up. Then it runs
SchedulerOutputs, which are data: it needs nothing else from the engine.
"""
from __future__ import annotations

import logging
import time

import torch

from lane import platform
from lane.config import EngineConfig
from lane.core.kv_cache_utils import get_kv_cache_config
from lane.core.scheduler_output import SchedulerOutput
from lane.kv_cache_interface import KVCacheConfig, group_kv_cache_specs
from lane.model_executor.layers import cpu_kernels
from lane.tracing import Step, tracer
from lane.model_executor.layers.linear import prepack_linears
from lane.model_executor.loader import get_model
from lane.outputs import ModelRunnerOutput
from lane.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, own_process: bool = False) -> None:
        """``own_process``: this process is the worker's alone (an engine core's), so its threads
        are pinned to CPUs by default; in a user's process (``LLM``) only on request, since the
        pinned main thread would hand its one CPU to every thread and process it starts."""
        self.config = config
        mc = config.model_config
        t0 = time.monotonic()
        self.threads = platform.set_threads(config.threads)  # step 1
        on_cpu = mc.device_type.type == "cpu"
        binding = platform.thread_binding(self.threads, "auto" if own_process else "nobind") if on_cpu else None
        if on_cpu:  # the compiler (first use on this CPU) runs while the weights load
            cpu_kernels.start_build()
        if tracer.enabled:
            tracer.record(Step.PLATFORM_INIT, t0, time.monotonic(), device=str(mc.device_type), dtype=str(mc.dtype),
                          threads=self.threads, cpu_isa=platform.cpu_isa() if on_cpu else None, cpu_bind=binding)
        torch.manual_seed(mc.seed)
        self.model = get_model(mc, config.load_threads, config.show_progress)  # step 4
        if on_cpu:
            cpu_kernels.build()
        if binding and cpu_kernels.available():  # after loading: the loader's threads would inherit one CPU
            cpu_kernels.bind_threads(binding)
            logger.info("Bound %d OpenMP threads to CPUs %s (LANE_CPU_OMP_THREADS_BIND=nobind leaves them unbound)",
                        len(binding), binding)
        self.num_packed = prepack_linears(self.model)
        self.runner = ModelRunner(self.model, config.cache_config.block_size, mc.dtype, mc.device_type,
                                  config.cache_config.enable_prefix_caching, mc.eos_token_ids)

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig | None = None) -> KVCacheConfig:
        """Step 8: group the layers' cache tensors by spec, size one pool per group from the
        budget (unless a config is given: another worker's, to match), allocate them."""
        cc, sc = self.config.cache_config, self.config.scheduler_config
        if kv_cache_config is None:
            groups = group_kv_cache_specs(self.runner.get_kv_cache_specs())
            kv_cache_config = get_kv_cache_config(groups, cc.budget_bytes(), sc.max_num_seqs,
                                                  sc.max_num_batched_tokens, sc.max_model_len)
        self.runner.initialize_kv_cache(kv_cache_config)
        return kv_cache_config

    def warmup(self) -> float:
        """Step 6: one prefill-shaped forward so oneDNN / MKL pick their kernels now."""
        t0 = time.monotonic()
        bs = self.config.cache_config.block_size
        n = min(64, self.config.scheduler_config.max_num_batched_tokens, bs * 2)
        self.runner.dummy_run(n)
        if hasattr(self.model, "moe_layers"):  # expert heat counts served tokens only
            for moe in self.model.moe_layers().values():
                moe.expert_counts.zero_()
        if tracer.enabled:
            tracer.record(Step.WORKER_WARMUP, t0, time.monotonic(), tokens=n)
        return time.monotonic() - t0

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

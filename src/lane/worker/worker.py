"""Worker: one per rank (the engine-core process itself at TP=1).

Start-up (seed steps 1, 4, 6, 8): threads and dtype, model load, KV pool
sizing from the memory budget, warm-up.
"""
from __future__ import annotations

import logging
import time

import torch

from lane import platform
from lane.config import EngineConfig
from lane.core.scheduler import SamplerResult, SchedulerOutput
from lane.model_executor.layers import cpu_kernels
from lane.tracing import Step, tracer
from lane.model_executor.layers.linear import prepack_linears
from lane.model_executor.loader import get_model
from lane.model_executor.layers.attention import AttentionMetadata, PrefillSpan, set_attention_metadata
from lane.core.kv_cache_utils import KVPoolPlan, plan_kv_pools, window_blocks_needed
from lane.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model_config
        t0 = time.monotonic()
        self.threads = platform.set_threads(config.threads)  # step 1
        on_cpu = mc.device_type.type == "cpu"
        if on_cpu:  # the compiler (first use on this CPU) runs while the weights load
            cpu_kernels.start_build()
        if tracer.enabled:
            tracer.record(Step.PLATFORM_INIT, t0, time.monotonic(), device=str(mc.device_type), dtype=str(mc.dtype),
                          threads=self.threads, cpu_isa=platform.cpu_isa() if on_cpu else None)
        torch.manual_seed(mc.seed)
        self.model = get_model(mc, config.load_threads, config.show_progress)  # step 4
        if on_cpu:
            cpu_kernels.build()
        self.num_packed = prepack_linears(self.model)
        self.runner = ModelRunner(self.model, config.cache_config.block_size, mc.dtype, mc.device_type,
                                  config.scheduler_config.max_num_seqs, mc.eos_token_ids)

    def determine_num_blocks(self) -> KVPoolPlan:
        """Step 8: blocks that fit the KV budget (one of them the null block); a model
        with a sliding-window group gets that group's pool first, sized to what the
        running requests' windows can hold at once."""
        cc, sc = self.config.cache_config, self.config.scheduler_config
        per_window_block = self.runner.kv_cache_bytes_per_block("window")
        window_blocks = (window_blocks_needed(self.runner.sliding_window, cc.block_size, sc.max_num_seqs,
                                              sc.max_num_batched_tokens) if per_window_block else 0)
        budget = cc.budget_bytes()
        plan = plan_kv_pools(budget, self.runner.kv_cache_bytes_per_block(), per_window_block, window_blocks)
        max_len = self.config.model_config.max_model_len
        need = -(-max_len // cc.block_size) + 1
        if plan.num_blocks < need:
            extra = plan.num_window_blocks * per_window_block
            raise ValueError(
                f"KV cache budget {budget / 2**20:.1f} MiB holds {plan.num_blocks} blocks of "
                f"{cc.block_size} tokens ({plan.bytes_per_block} B each"
                + (f", after {extra} B for the sliding-window pool" if extra else "")
                + f"), but one request of max_model_len {max_len} needs {need}; raise "
                f"--kv-cache-memory-bytes to at least {need * plan.bytes_per_block + extra} or lower --max-model-len")
        return plan

    def initialize_cache(self, plan: KVPoolPlan) -> None:
        self.runner.allocate_kv_cache(plan.num_blocks, plan.num_window_blocks)

    @torch.inference_mode()
    def warmup(self) -> float:
        """Step 6: one prefill-shaped forward so oneDNN / MKL pick their kernels now."""
        t0 = time.monotonic()
        bs = self.config.cache_config.block_size
        n = min(64, self.config.scheduler_config.max_num_batched_tokens, bs * 2)
        ids = torch.zeros(n, dtype=torch.long)
        pos = torch.arange(n)
        # write into blocks 1.. (not yet handed out), then re-zero them
        blocks = torch.arange(1, 1 + -(-n // bs))
        md = AttentionMetadata(slot_mapping=pos + bs, window_slot_mapping=pos + bs,
                               prefills=[PrefillSpan(0, n, 0, blocks, window_block_ids=blocks)])
        with set_attention_metadata(md):
            self.model.compute_logits(self.model(ids, pos)[-1:])
        for cache in self.runner.kv_caches:
            cache[1:1 + -(-n // bs)].zero_()
        if hasattr(self.model, "moe_layers"):  # expert heat counts served tokens only
            for moe in self.model.moe_layers().values():
                moe.expert_counts.zero_()
        if tracer.enabled:
            tracer.record(Step.WORKER_WARMUP, t0, time.monotonic(), tokens=n)
        return time.monotonic() - t0

    def execute_model(self, sched: SchedulerOutput) -> dict[str, SamplerResult]:
        return self.runner.execute_model(sched)

"""Worker: one per rank (the engine-core process itself at TP=1).

Start-up (seed steps 1, 2, 5, 4, 6, 8): threads and dtype, the process groups (more than one
rank) handed to the layers, model load (this rank's slice), the KV cache (specs grouped,
pools sized from the memory budget, allocated), warm-up. Then it runs SchedulerOutputs,
which are data: it needs nothing else from the engine. Every rank samples the same tokens
from the same gathered logits with the same seeds, so every rank's InputBatch stays the same.
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
from lane.model_executor.layers.linear import kernels_in_float32, prepack_linears
from lane.model_executor.loader import get_model
from lane.outputs import ModelRunnerOutput
from lane.worker.model_runner import ModelRunner
from lane.worker.weight_arena import move_weights_to_huge_pages

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, own_process: bool = False, rank: int = 0,
                 ranks_on_node: int = 1) -> None:
        """``own_process``: this process is the worker's alone (an engine core's or a worker
        process), so its threads are pinned to CPUs by default; in a user's process (``LLM``)
        only on request, since the pinned main thread would hand its one CPU to every thread
        and process it starts. ``ranks_on_node``: the ranks sharing this machine's KV budget."""
        self.config = config
        self.rank, self.ranks_on_node = rank, ranks_on_node
        mc, pc = config.model_config, config.parallel_config
        if tracer.enabled:
            tracer.rank = rank
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
        if pc.model_world_size > 1:
            self._init_distributed(pc, mc.device_type)
        from lane.distributed.parallel_state import ExpertPlacement, set_expert_placement

        set_expert_placement(ExpertPlacement(pc.enable_eplb, pc.eplb_config.num_redundant_experts if pc.enable_eplb
                                             else 0))
        spec = config.speculative_config
        self.model = get_model(mc, config.load_threads, config.show_progress and rank == 0,  # step 4
                               draft_dir=spec.model if spec is not None else None)
        self.eplb = self._init_eplb(pc, mc.hf_config) if pc.enable_eplb else None
        if on_cpu:
            cpu_kernels.build()
        if binding and cpu_kernels.available():  # after loading: the loader's threads would inherit one CPU
            cpu_kernels.bind_threads(binding)
            logger.info("Bound %d OpenMP threads to CPUs %s (LANE_CPU_OMP_THREADS_BIND=nobind leaves them unbound)",
                        len(binding), binding)
        spec = config.speculative_config
        if spec is not None and spec.method == "mtp":
            if not getattr(self.model, "num_mtp_layers", 0):
                raise ValueError(f"--speculative-config method 'mtp': {mc.short_name} has no MTP weights "
                                 f"(num_nextn_predict_layers is set, but the checkpoint carries no MTP layer; "
                                 f"use method 'ngram')")
            self.model.kv_cache_skip = ()  # the MTP layers run now: they get caches
            if hasattr(self.model, "keep_streams"):
                self.model.keep_streams = True
        self.num_packed = prepack_linears(self.model)
        kernels_in_float32(self.model)
        if on_cpu:  # (after packing: the packed blocks are what the steps read)
            move_weights_to_huge_pages(self.model)
        self.runner = ModelRunner(self.model, config.cache_config.block_size, mc.dtype, mc.device_type,
                                  config.cache_config.enable_prefix_caching, mc.eos_token_ids, spec,
                                  config.scheduler_config.max_model_len, config.cache_config.kv_cache_dtype)

    def _init_distributed(self, pc, device: torch.device) -> None:
        """Steps 2 and 5: join the replica's world, hand the groups to the layers built next."""
        from lane.distributed.parallel_state import (init_distributed, set_dsa_context_parallel, set_model_parallel,
                                                     set_sequence_parallel)

        t0 = time.monotonic()
        if device.type == "cuda":  # one GPU per local rank (NCCL refuses two ranks on one)
            torch.cuda.set_device(self.rank % pc.ranks_per_node % max(1, torch.cuda.device_count()))
        if pc.data_parallel_expert:  # every replica's ranks in one world, the experts over all of them
            tp, ep = init_distributed(pc.model_world_size, pc.first_rank + self.rank, "127.0.0.1",
                                      pc.data_parallel_master_port, pc.worker_timeout, device, True,
                                      tp_size=pc.tensor_parallel_size)
        else:
            tp, ep = init_distributed(pc.world_size, self.rank, pc.master_addr, pc.master_port, pc.worker_timeout,
                                      device, pc.enable_expert_parallel)
        t1 = time.monotonic()
        set_model_parallel(tp, ep)
        set_sequence_parallel(pc.enable_sequence_parallel)
        set_dsa_context_parallel(pc.enable_dsa_cp)
        if tracer.enabled:
            backend = "nccl" if device.type == "cuda" else "gloo"
            tracer.record(Step.DIST_INIT, t0, t1, backend=backend, world=pc.world_size, tp=tp.world_size,
                          ep=ep.world_size, dp=pc.data_parallel_size, nnodes=pc.nnodes,
                          rendezvous=f"tcp://{pc.master_addr}:{pc.master_port}")
            tracer.record(Step.DIST_BIND_GROUPS, t1, time.monotonic(), tp_rank=tp.rank_in_group,
                          ep_rank=ep.rank_in_group)

    def _init_eplb(self, pc, hf_config):
        """Step 7: the initial expert map (redundant slots to experts i % E) and EPLB's state."""
        from lane.distributed.parallel_state import get_ep_group
        from lane.eplb.state import EplbState

        t0 = time.monotonic()
        ep = get_ep_group()
        groups = int(getattr(hf_config, "n_group", None) or 1)
        nodes = pc.nnodes if ep.world_size % pc.nnodes == 0 else 1
        state = EplbState(self.model.moe_layers(), pc.eplb_config, ep, groups, nodes)
        if tracer.enabled:
            tracer.record(Step.EPLB_INITIAL_PLACEMENT, t0, time.monotonic(), **state.describe())
        return state

    def determine_kv_cache_config(self) -> KVCacheConfig:
        """This rank's share of the budget (ranks on one machine split it), in blocks: every rank
        holds the same blocks of its own heads, so rank 0's config fits them all."""
        cc, sc = self.config.cache_config, self.config.scheduler_config
        groups = group_kv_cache_specs(self.runner.get_kv_cache_specs())
        return get_kv_cache_config(groups, cc.budget_bytes() // self.ranks_on_node, sc.max_num_seqs,
                                   sc.max_num_batched_tokens, sc.max_model_len)

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig | None = None) -> KVCacheConfig:
        """Step 8: group the layers' cache tensors by spec, size one pool per group from the
        budget (unless a config is given: another worker's, to match), allocate them."""
        kv_cache_config = kv_cache_config or self.determine_kv_cache_config()
        self.runner.initialize_kv_cache(kv_cache_config)
        ktc = self.config.kv_transfer_config
        if ktc is not None:  # the worker's half of the KV connector, on this rank's cache tensors
            from lane.kv_transfer.base import KVConnectorRole, layout_of
            from lane.kv_transfer.factory import create_connector

            mc = self.config.model_config
            connector = create_connector(ktc, KVConnectorRole.WORKER, kv_cache_config, layout_of(mc, kv_cache_config),
                                         self.rank, self.config.parallel_config.world_size)
            connector.register_kv_caches(self.runner.kv_caches)
            self.runner.connector = connector
        return kv_cache_config

    def weight_bytes(self) -> int:
        from lane.model_executor.loader import resident_weight_bytes

        return resident_weight_bytes(self.model)

    def checkpoint_bytes_read(self) -> tuple[int, int]:
        """(bytes this rank read of the checkpoint, the checkpoint's bytes): a rank reads its slices."""
        return getattr(self.model, "checkpoint_bytes_read", (0, 0))

    def expert_counts(self) -> dict[int, list[int]]:
        """Tokens each expert served on this rank, per MoE layer (summed over ranks by the caller)."""
        layers = self.model.moe_layers() if hasattr(self.model, "moe_layers") else {}
        return {i: m.expert_counts.tolist() for i, m in layers.items()}

    def expert_slots(self) -> dict[int, tuple[list[int], list[torch.Tensor]]]:
        """Per MoE layer: the logical expert each of this rank's slots holds, and the slots' weight
        tensors (with quantized experts' scales and sums): what EPLB's moves can be checked by."""
        layers = self.model.moe_layers() if hasattr(self.model, "moe_layers") else {}
        return {i: (m.local_logical().tolist(), [t.clone() for t in m.slot_tensors()]) for i, m in layers.items()}

    def eplb_window_load(self) -> torch.Tensor:
        """[MoE layers, physical slots]: the tokens this rank's slots served over EPLB's window."""
        return self.eplb.window.sum(0)

    def collective_stats(self) -> dict[int, tuple[int, int, float]]:
        """Seed step -> (collectives, bytes, seconds) on this rank since the last call."""
        from lane.distributed.parallel_state import get_tp_group

        return {step: (s.calls, s.bytes, s.seconds) for step, s in get_tp_group().take_stats().items()}

    def warmup(self) -> float:
        """Step 6: one prefill-shaped forward so oneDNN / MKL pick their kernels now."""
        t0 = time.monotonic()
        bs = self.config.cache_config.block_size
        n = min(64, self.config.scheduler_config.max_num_batched_tokens, bs * 2)
        self.runner.dummy_run(n)
        if hasattr(self.model, "moe_layers"):  # expert heat counts served tokens only
            for moe in self.model.moe_layers().values():
                moe.expert_counts.zero_()
        if self.eplb is not None:
            self.eplb.clear_step()
        if tracer.enabled:
            tracer.record(Step.WORKER_WARMUP, t0, time.monotonic(), tokens=n)
        return time.monotonic() - t0

    def execute_dummy_batch(self):
        """A forward of one dummy token (the null block's slots), for replicas in lock-step;
        returns EPLB's stats when they changed (its step count stays with the other ranks')."""
        self.runner.dummy_run(1, null_block=True)
        return self.eplb.step() if self.eplb is not None else None

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        out = self.runner.execute_model(scheduler_output)
        # steps 53-54 when their step comes; the stats when they changed. A connector-only step
        # (no forward) is no step: in lock-step the replicas' counts (and collectives) must agree
        if self.eplb is not None and scheduler_output.total_num_scheduled_tokens:
            out.eplb_stats = self.eplb.step()
        return out

"""EngineCore: the scheduler, the KV manager and the worker, stepped in a loop
(seed steps 8, 9, 14, 15-19, 35-37)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from lane.config import EngineConfig
from lane.core.request import Request, RequestStatus
from lane.core.scheduler import EngineCoreOutput, Scheduler
from lane.model_executor.layers import cpu_kernels
from lane.sampling_params import SamplingParams
from lane.worker.worker import Worker

logger = logging.getLogger(__name__)


@dataclass
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    cache_salt: str | None = None


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        t0 = time.perf_counter()
        self.config = config
        self.worker = Worker(config)
        cc = config.cache_config
        cc.num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_cache(cc.num_blocks)
        self.warmup_s = self.worker.warmup()
        self.scheduler = Scheduler(config.scheduler_config, cc, config.model_config.eos_token_ids)
        self.kv_cache_bytes = cc.num_blocks * self.worker.runner.kv_cache_bytes_per_block()
        self.init_s = time.perf_counter() - t0
        mc = config.model_config
        logger.info("Model %s: %s, dtype %s, %d threads, CPU kernels %s, max_model_len %d",
                    mc.short_name, mc.architectures[0] if mc.architectures else "?",
                    str(mc.dtype).removeprefix("torch."), self.worker.threads,
                    "on" if cpu_kernels.available() else "off", mc.max_model_len)
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB of a %.1f MiB budget); "
                    "prefix caching %s; init (load, KV pool, warm-up) took %.2f s",
                    cc.num_blocks - 1, cc.block_size, (cc.num_blocks - 1) * cc.block_size,
                    self.kv_cache_bytes / 2**20, cc.budget_bytes() / 2**20,
                    "on" if cc.enable_prefix_caching else "off", self.init_s)

    @property
    def max_model_len(self) -> int:
        return self.config.model_config.max_model_len

    def add_request(self, req: EngineCoreRequest) -> None:
        n = len(req.prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n > self.max_model_len:
            raise ValueError(f"the prompt has {n} tokens, longer than the maximum model "
                             f"length of {self.max_model_len}")
        vocab = self.config.model_config.hf_config.vocab_size
        if max(req.prompt_token_ids) >= vocab or min(req.prompt_token_ids) < 0:
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        self.scheduler.add_request(Request(
            req.request_id, list(req.prompt_token_ids), req.sampling_params,
            arrival_time=req.arrival_time or time.monotonic(), cache_salt=req.cache_salt))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineCoreOutput]:
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        sampled = self.worker.execute_model(sched)
        return self.scheduler.update_from_output(sched, sampled)

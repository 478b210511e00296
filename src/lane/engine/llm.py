"""Offline inference: ``LLM(...).generate(prompts, SamplingParams(...))``.

The same EngineCore the server runs, in-process, with no HTTP and no IPC.
Tokenisation, chat templates and detokenisation stay here (the frontend side).
"""
from __future__ import annotations

import itertools
import logging
from typing import Iterator, Sequence

from tqdm import tqdm

from lane.config import EngineArgs
from lane.engine.core import EngineCore, start_cpu_kernel_build
from lane.engine.messages import EngineCoreRequest
from lane.engine.output_processor import OutputProcessor
from lane.engine.processor import InputProcessor, PromptType
from lane.outputs import RequestOutput
from lane.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLM:
    def __init__(self, model: str | None = None, *, dtype: str = "auto", block_size: int | None = None,
                 enable_prefix_caching: bool = True, max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 128, max_model_len: int | None = None,
                 kv_cache_memory_bytes: int | None = None, seed: int = 0,
                 threads: int | None = None, show_progress: bool = True, quantization: str = "auto",
                 tensor_parallel_size: int = 1, data_parallel_size: int = 1, enable_expert_parallel: bool = False,
                 distributed_executor_backend: str | None = None, nnodes: int = 1, node_rank: int = 0,
                 master_addr: str = "127.0.0.1", master_port: int = 29500, worker_timeout: float = 60.0,
                 speculative_config: dict | str | None = None, device: str | None = None,
                 rpc_secret_file: str | None = None, enable_eplb: bool = False,
                 eplb_config: dict | str | None = None, kv_transfer_config: dict | str | None = None,
                 enable_sequence_parallel: bool = False, enable_dsa_cp: bool = False,
                 kv_cache_dtype: str = "auto") -> None:
        if data_parallel_size != 1:
            raise ValueError(f"data_parallel_size {data_parallel_size}: offline LLM runs one replica; "
                             f"serve replicas with lane serve --data-parallel-size")
        if node_rank:
            raise ValueError("node_rank > 0 runs workers only: start it with lane serve --headless")
        args = EngineArgs(model, dtype, block_size, enable_prefix_caching, max_num_batched_tokens,
                          max_num_seqs, max_model_len, kv_cache_memory_bytes, seed, threads,
                          show_progress, quantization, tensor_parallel_size=tensor_parallel_size,
                          enable_expert_parallel=enable_expert_parallel,
                          distributed_executor_backend=distributed_executor_backend, nnodes=nnodes,
                          master_addr=master_addr, master_port=master_port, worker_timeout=worker_timeout,
                          speculative_config=speculative_config, device=device, rpc_secret_file=rpc_secret_file,
                          enable_eplb=enable_eplb, eplb_config=eplb_config,
                          kv_transfer_config=kv_transfer_config, enable_sequence_parallel=enable_sequence_parallel,
                          enable_dsa_cp=enable_dsa_cp, kv_cache_dtype=kv_cache_dtype)
        start_cpu_kernel_build()
        self.config = args.create_engine_config()
        self.tokenizer = self.config.model_config.get_tokenizer()
        self.processor = InputProcessor(self.config.model_config, self.tokenizer)
        self.engine = EngineCore(self.config)
        self.output_processor = OutputProcessor(self.tokenizer, self.config.model_config.eos_token_ids)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def shutdown(self) -> None:
        """Stop the worker processes (if any); the LLM serves nothing after."""
        self.engine.shutdown()

    # -- requests -------------------------------------------------------------
    def _process(self, prompt: PromptType, params: SamplingParams) -> tuple[str | None, list[int]]:
        """Tokenise and validate a prompt (raises on one the engine cannot serve)."""
        text, ids = self.processor.tokenize(prompt)
        self.processor.validate(ids, params)
        return text, ids

    def _add_request(self, prompt: PromptType, params: SamplingParams, stream: bool = False) -> str:
        return self._add_processed(*self._process(prompt, params), params, stream)

    def _add_processed(self, text: str | None, ids: list[int], params: SamplingParams,
                       stream: bool = False) -> str:
        rid = str(next(self._ids))
        for cid, cp in self.output_processor.add_request(rid, text, ids, params, stream):
            self.engine.add_request(EngineCoreRequest(cid, ids, cp))
        return rid

    def _step(self) -> list[RequestOutput]:
        outputs, stop_now = self.output_processor.process_outputs(self.engine.step())
        if stop_now:  # a stop string was found by the detokenizer
            self.engine.abort_requests(stop_now)
        return outputs

    # -- public API ---------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        # all validated before any is queued: a bad prompt must leave nothing in the engine
        processed = [self._process(p, sp) for p, sp in zip(prompts, params)]
        order = [self._add_processed(text, ids, sp) for (text, ids), sp in zip(processed, params)]
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(order), desc="Processed prompts", unit="req",
                  disable=not use_tqdm or not self.config.show_progress) as bar:
            while self.output_processor.has_unfinished():
                for out in self._step():
                    results[out.request_id] = out
                    bar.update(1)
        return [results[rid] for rid in order]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.apply_chat_template(c, add_generation_prompt, chat_template),
                    "prompt": None} for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None) -> list[int]:
        return self.processor.apply_chat_template(messages, add_generation_prompt, chat_template)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas of one prompt's first sample as they are generated."""
        rid = self._add_request(prompt, sampling_params or SamplingParams(), stream=True)
        try:
            while True:
                for out in self._step():
                    if out.request_id == rid:
                        if out.outputs[0].text:
                            yield out.outputs[0].text
                        if out.finished:
                            return
        finally:
            self.engine.abort_requests(self.output_processor.abort(rid))

    @property
    def prefix_cache_stats(self):
        return self.engine.scheduler.kv.stats

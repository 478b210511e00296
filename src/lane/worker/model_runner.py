"""ModelRunner: one flattened batch per step (seed steps 20, 32, 34).

It runs from ``SchedulerOutput``s alone: its ``InputBatch`` keeps each request's tokens,
block tables and sampling state. Decodes (query length 1) come first, then prefill
chunks. The attention backend builds each KV cache group's metadata; only rows that
end a request's pending tokens go through the LM head and the sampler.
"""
from __future__ import annotations

import math
import mmap
import time

import torch
import torch.nn as nn

from lane import platform, tracing
from lane.attention.metadata import CommonAttentionMetadata, set_forward_context
from lane.core.scheduler_output import SchedulerOutput
from lane.kv_cache_interface import STATE, KVCacheConfig, KVCacheSpec
from lane.model_executor.layers.attention import CacheLayer, cache_layers, kv_cache_specs
from lane.model_executor.layers.sampler import SamplingMetadata, sample
from lane.outputs import ModelRunnerOutput
from lane.tracing import Step, tracer
from lane.worker.input_batch import InputBatch, ScheduledRequest


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. On a CPU, a large one is anonymous memory from the kernel: its zero
    pages are mapped when first touched, so a pool of gigabytes costs nothing at start-up
    (torch.zeros writes every byte first: seconds for the default 4 GiB budget)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < (1 << 20):
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


class ModelRunner:
    def __init__(self, model: nn.Module, block_size: int, dtype: torch.dtype, device: torch.device,
                 enable_prefix_caching: bool = True, eos_token_ids: list[int] | None = None) -> None:
        self.model = model
        self.eos_token_ids = list(eos_token_ids or [])  # masked, with stop_token_ids, before min_tokens
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.enable_prefix_caching = enable_prefix_caching
        self.cache_layers: dict[str, CacheLayer] = cache_layers(model)
        config = model.config
        self.num_layers = getattr(config, "num_hidden_layers", None) or len(self.cache_layers)
        choice = platform.select_attention_backend(config)
        self.attn_backend = choice.backend
        # what traces say about step 27
        self.attention_attrs = {Step.OPS_ATTENTION: {"backend": choice.name, "why": choice.reason}}
        self.kv_cache_config: KVCacheConfig | None = None
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.input_batch = InputBatch()

    # -- step 8: the cache tensors -------------------------------------------
    def get_kv_cache_specs(self) -> dict[str, KVCacheSpec]:
        """Every cache tensor's spec, named "<module>.<tensor>"."""
        return kv_cache_specs(self.model, self.block_size, self.dtype, self.enable_prefix_caching)

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate each group's pool and bind every tensor to its layer. Zeroed: padded and
        not-yet-written slots are read (then masked), and must hold finite values."""
        self.kv_cache_config = kv_cache_config
        for g, (group, n) in enumerate(zip(kv_cache_config.groups, kv_cache_config.num_blocks)):
            for name, spec in zip(group.layer_names, group.specs):
                module, _, attr = name.rpartition(".")
                t = zeros((n, *spec.shape), spec.dtype, self.device)
                self.cache_layers[module].bind_kv_cache(attr, t, g)
                self.kv_caches[name] = t

    # -- step 20: inputs ---------------------------------------------------------
    def _attn_metadata(self, common: CommonAttentionMetadata, block_ids: list[tuple[list[int], ...]]) -> list:
        """Each group's metadata, built by the backend from that group's block ids."""
        return [self.attn_backend.build_metadata(group, common, [ids[g] for ids in block_ids])
                for g, group in enumerate(self.kv_cache_config.groups)]

    def _prepare(self, batch: list[ScheduledRequest]):
        input_ids: list[int] = []
        positions: list[int] = []
        starts: list[int] = []
        ends: list[int] = []
        for s in batch:
            st = s.state
            start = st.num_computed_tokens
            starts.append(len(input_ids))
            input_ids.extend(st.token_ids[start:start + s.num_tokens])
            positions.extend(range(start, start + s.num_tokens))
            ends.append(len(input_ids))
        common = CommonAttentionMetadata(sum(s.is_decode for s in batch), starts, ends,
                                         [s.state.num_computed_tokens for s in batch], [s.state.fresh for s in batch])
        md = self._attn_metadata(common, [s.state.block_ids for s in batch])
        # rows whose token is the request's last pending one: these get logits
        sampling = [s for s in batch if s.samples]
        sample_rows = [e - 1 for s, e in zip(batch, ends) if s.samples]
        return (torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                md, sample_rows, sampling)

    def _sampling_metadata(self, sampling: list[ScheduledRequest]) -> SamplingMetadata:
        states = [s.state for s in sampling]
        params = [st.sampling_params for st in states]
        temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        md = SamplingMetadata(temperature=temps, all_greedy=all(p.greedy for p in params),
                              num_logprobs=[p.logprobs for p in params])
        if not md.all_greedy:
            if any(p.top_k > 0 for p in params):
                md.top_k = torch.tensor([p.top_k for p in params], dtype=torch.long)
            if any(p.top_p < 1.0 for p in params):
                md.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
            if any(p.min_p > 0.0 for p in params):
                md.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
            md.generators = {i: st.generator for i, st in enumerate(states) if st.generator is not None}
        for i, st in enumerate(states):
            p = st.sampling_params
            if len(st.output_token_ids) < p.min_tokens:
                stops = p.stop_token_ids + ([] if p.ignore_eos else self.eos_token_ids)
                if stops:
                    md.masked_token_ids[i] = stops
        if any(p.uses_penalties for p in params):
            md.presence_penalty = torch.tensor([p.presence_penalty for p in params])
            md.frequency_penalty = torch.tensor([p.frequency_penalty for p in params])
            md.repetition_penalty = torch.tensor([p.repetition_penalty for p in params])
            md.prompt_token_ids = [st.prompt_token_ids for st in states]
            md.output_token_ids = [st.output_token_ids for st in states]
        return md

    # -- one step ------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        prof = tracing.forward_profile()  # None unless tracing
        t0 = time.monotonic() if prof else 0.0
        batch = self.input_batch.update(so)
        input_ids, positions, md, sample_rows, sampling = self._prepare(batch)  # step 20
        for s in batch:
            s.state.fresh = False
        if prof:
            ids = [s.state.req_id for s in batch]
            nd = sum(s.is_decode for s in batch)
            tracer.record(Step.RUNNER_PREPARE_INPUTS, t0, time.monotonic(), ids, tokens=len(input_ids),
                          decodes=nd, prefill_chunks=len(batch) - nd)
            prof.begin()
        with set_forward_context(md):
            hidden = self.model(input_ids, positions)
        if not sample_rows:
            if prof:
                prof.emit(ids, self.num_layers, self.attention_attrs)
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden[sample_rows])  # step 32
        if prof:
            prof.mark(Step.MODEL_LM_HEAD)
            prof.emit(ids, self.num_layers, self.attention_attrs)
            t_sample = time.monotonic()
        out = sample(logits, self._sampling_metadata(sampling))  # step 34
        if prof:
            tracer.record(Step.RUNNER_SAMPLE, t_sample, time.monotonic(), [s.state.req_id for s in sampling],
                          rows=len(sampling), greedy=all(s.state.sampling_params.greedy for s in sampling))
        for s, tok in zip(sampling, out.token_ids):
            s.state.append_output_token(tok)
        return ModelRunnerOutput([s.state.req_id for s in sampling], [[tok] for tok in out.token_ids],
                                 [[lp] if lp is not None else None for lp in out.logprobs]
                                 if any(lp is not None for lp in out.logprobs) else None)

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int) -> None:
        """One prefill-shaped forward of a request in blocks (and state slot) 1.., not yet
        handed out; their cache entries are zeroed again after."""
        bs = self.block_size
        num_blocks = -(-num_tokens // bs)
        common = CommonAttentionMetadata(0, [0], [num_tokens], [0], [True])
        ids = tuple([1] if g.kind == STATE else list(range(1, 1 + num_blocks)) for g in self.kv_cache_config.groups)
        with set_forward_context(self._attn_metadata(common, [ids])):
            pos = torch.arange(num_tokens)
            self.model.compute_logits(self.model(torch.zeros(num_tokens, dtype=torch.long), pos)[-1:])
        for t in self.kv_caches.values():
            t[1:1 + num_blocks].zero_()

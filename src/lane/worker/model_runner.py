"""ModelRunner: one flattened batch per step (seed steps 20, 32, 34).

Decodes (query length 1) come first, then prefill chunks. Only rows that end a
request's pending tokens go through the LM head and the sampler.
"""
from __future__ import annotations

import math
import mmap
import time

import torch
import torch.nn as nn

from lane.core.scheduler import SamplerResult, SchedulerOutput, ScheduledRequest
from lane.model_executor.layers.attention import AttentionMetadata, PrefillSpan, set_attention_metadata
from lane.model_executor.layers.sampler import SamplingMetadata, sample
from lane import platform, tracing
from lane.tracing import Step, tracer


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
    def __init__(self, model: nn.Module, block_size: int, dtype: torch.dtype,
                 device: torch.device, max_num_seqs: int = 128, eos_token_ids: list[int] | None = None) -> None:
        self.model = model
        self.eos_token_ids = list(eos_token_ids or [])  # masked, with stop_token_ids, before min_tokens
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.kv_caches: list[torch.Tensor] = []
        self.cache_layers = model.kv_cache_layers()
        config = getattr(model, "config", None)
        self.num_layers = getattr(config, "num_hidden_layers", None) or len(self.cache_layers)
        # one running-state slot per running request (+ slot 0, unused), if any layer keeps state
        self.num_state_slots = max_num_seqs + 1 if any(l.state_shapes() for l in self.cache_layers) else 0
        # tokens the sliding-window group keeps (0: every cache tensor is in the main pool)
        self.sliding_window = max((l.sliding_window for l in self.cache_layers), default=0)
        backend = platform.select_attention_backend(config) if config is not None else None
        # what traces say about step 27
        self.attention_attrs = {Step.OPS_ATTENTION: {"backend": backend.name, "why": backend.reason}} if backend else {}

    # -- step 8: the cache tensors -------------------------------------------
    def kv_cache_bytes_per_block(self, group: str = "full") -> int:
        """Bytes one block of the main pool ("full") or the window group's pool takes."""
        return sum(math.prod(shape) * (layer.cache_dtype(name) or self.dtype).itemsize
                   for layer in self.cache_layers for name, shape in layer.cache_shapes(self.block_size).items()
                   if layer.cache_group(name) == group)

    def allocate_kv_cache(self, num_blocks: int, num_window_blocks: int = 0) -> None:
        self.kv_caches = []
        for layer in self.cache_layers:
            for name, shape in layer.cache_shapes(self.block_size).items():
                n = num_window_blocks if layer.cache_group(name) == "window" else num_blocks
                # zeroed: padded and not-yet-written slots are read (then masked), and
                # must hold finite values
                t = zeros((n, *shape), layer.cache_dtype(name) or self.dtype, self.device)
                setattr(layer, name, t)
                self.kv_caches.append(t)
            for name, shape in layer.state_shapes().items():
                setattr(layer, name, zeros((self.num_state_slots, *shape), torch.float32, self.device))

    # -- step 20: inputs ---------------------------------------------------------
    def _prepare(self, sched: SchedulerOutput):
        bs = self.block_size
        # decodes first (stable); a fresh request's first chunk is a prefill even at one token
        order = sorted(sched.scheduled, key=lambda s: s.num_tokens != 1 or s.fresh)
        decodes = [s for s in order if s.num_tokens == 1 and not s.fresh]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        window = sched.scheduled[0].window_block_ids is not None if sched.scheduled else False
        wslots: list[int] = []

        def slot(block_ids: list[int], p: int) -> int:
            return block_ids[p // bs] * bs + p % bs

        for s in decodes:
            r = s.request
            p = r.num_computed_tokens
            input_ids.append(r.all_token_ids[p])
            positions.append(p)
            slots.append(slot(s.block_ids, p))
            if window:
                wslots.append(slot(s.window_block_ids, p))
        prefills: list[PrefillSpan] = []
        offset = len(decodes)
        for s in order[len(decodes):]:
            r = s.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_tokens
            input_ids.extend(r.all_token_ids[start:end])
            pos = range(start, end)
            positions.extend(pos)
            slots.extend(slot(s.block_ids, p) for p in pos)
            n_blocks = -(-end // bs)
            span = PrefillSpan(offset, offset + s.num_tokens, start,
                               torch.tensor(s.block_ids[:n_blocks], dtype=torch.long), s.state_slot, s.fresh)
            if window:
                wslots.extend(slot(s.window_block_ids, p) for p in pos)
                span.window_block_ids = torch.tensor(s.window_block_ids[:n_blocks], dtype=torch.long)
            prefills.append(span)
            offset += s.num_tokens
        md = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long),
                               num_decodes=len(decodes), prefills=prefills)
        if window:
            md.window_slot_mapping = torch.tensor(wslots, dtype=torch.long)
        if decodes:
            max_blocks = max(-(-(s.request.num_computed_tokens + 1) // bs) for s in decodes)

            def table(rows: list[list[int]]) -> torch.Tensor:  # [B, max_blocks], null-padded
                return torch.tensor([ids[:max_blocks] + [0] * (max_blocks - min(len(ids), max_blocks))
                                     for ids in rows], dtype=torch.long)

            md.decode_block_tables = table([s.block_ids for s in decodes])
            md.decode_context_lens = torch.tensor(
                [s.request.num_computed_tokens + 1 for s in decodes], dtype=torch.int32)
            md.decode_state_slots = [s.state_slot for s in decodes]
            if window:
                md.decode_window_tables = table([s.window_block_ids for s in decodes])
        # rows whose token is the request's last pending one: these get logits
        sample_rows: list[int] = []
        sampling: list[ScheduledRequest] = []
        row = 0
        for s in order:
            row += s.num_tokens
            if s.samples:
                sample_rows.append(row - 1)
                sampling.append(s)
        return (torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                md, sample_rows, sampling)

    def _sampling_metadata(self, sampling: list[ScheduledRequest]) -> SamplingMetadata:
        params = [s.request.sampling_params for s in sampling]
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
            md.generators = {i: s.request.generator for i, s in enumerate(sampling)
                             if s.request.generator is not None}
        for i, s in enumerate(sampling):
            p = s.request.sampling_params
            if s.request.num_output_tokens < p.min_tokens:
                stops = p.stop_token_ids + ([] if p.ignore_eos else self.eos_token_ids)
                if stops:
                    md.masked_token_ids[i] = stops
        if any(p.uses_penalties for p in params):
            md.presence_penalty = torch.tensor([p.presence_penalty for p in params])
            md.frequency_penalty = torch.tensor([p.frequency_penalty for p in params])
            md.repetition_penalty = torch.tensor([p.repetition_penalty for p in params])
            md.prompt_token_ids = [s.request.prompt_token_ids for s in sampling]
            md.output_token_ids = [s.request.output_token_ids for s in sampling]
        return md

    # -- one step ------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> dict[str, SamplerResult]:
        prof = tracing.forward_profile()  # None unless tracing
        t0 = time.monotonic() if prof else 0.0
        input_ids, positions, md, sample_rows, sampling = self._prepare(sched)  # step 20
        if prof:
            ids = [s.request.request_id for s in sched.scheduled]
            tracer.record(Step.RUNNER_PREPARE_INPUTS, t0, time.monotonic(), ids, tokens=len(input_ids),
                          decodes=md.num_decodes, prefill_chunks=len(md.prefills))
            prof.begin()
        with set_attention_metadata(md):
            hidden = self.model(input_ids, positions)
        if not sample_rows:
            if prof:
                prof.emit(ids, self.num_layers, self.attention_attrs)
            return {}
        logits = self.model.compute_logits(hidden[sample_rows])  # step 32
        if prof:
            prof.mark(Step.MODEL_LM_HEAD)
            prof.emit(ids, self.num_layers, self.attention_attrs)
            t_sample = time.monotonic()
        out = sample(logits, self._sampling_metadata(sampling))  # step 34
        if prof:
            tracer.record(Step.RUNNER_SAMPLE, t_sample, time.monotonic(), [s.request.request_id for s in sampling],
                          rows=len(sampling), greedy=all(s.request.sampling_params.greedy for s in sampling))
        return {s.request.request_id: SamplerResult(tok, lp)
                for s, tok, lp in zip(sampling, out.token_ids, out.logprobs)}

"""ModelRunner: one flattened batch per step (seed steps 20, 32, 34).

It runs from ``SchedulerOutput``s alone: its ``InputBatch`` keeps each request's tokens,
block tables and sampling state. Decodes (query length 1) come first, then prefill
chunks. The attention backend builds each KV cache group's metadata; only rows that
end a request's pending tokens go through the LM head and the sampler.
"""
from __future__ import annotations

import math
import mmap
import queue
import threading
import time

import torch
import torch.nn as nn

from lane import platform, tracing
from lane.attention.metadata import BatchLayout, CommonAttentionMetadata, set_forward_context
from lane.core.scheduler_output import SchedulerOutput
from lane.distributed.parallel_state import sequence_parallel_step
from lane.kv_cache_interface import STATE, KVCacheConfig, KVCacheSpec
from lane.model_executor.layers.attention import CacheLayer, cache_layers, kv_cache_specs, set_kv_cache_dtype
from lane.config import SpeculativeConfig
from lane.model_executor.layers.sampler import SamplingMetadata, sample, target_distribution, token_logprobs
from lane.outputs import ModelRunnerOutput
from lane.spec_decode.mtp_proposer import MtpProposer, MtpRows
from lane.spec_decode.ngram_proposer import NgramProposer
from lane.spec_decode.rejection_sampler import rejection_sample
from lane.tracing import Step, tracer
from lane.worker.input_batch import CachedRequestState, InputBatch, ScheduledRequest


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. On a CPU, a large one is anonymous memory from the kernel: its zero
    pages cost nothing at start-up (torch.zeros writes every byte first: seconds for the
    default 4 GiB budget), and a thread maps them in the background (_Populate)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < (1 << 20):
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # (Not MADV_HUGEPAGE: 2 MiB pages spared decode attention a TLB miss per block, 8 % of it at
    # 64 rows, but each cost ~5 ms to fault in on a VM, 10x 4 KiB pages, and the first token of
    # a request that reached new blocks waited for them: TTFT +20 ms at concurrency 1.)
    t = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)
    _populate.put((buf, t.data_ptr(), nbytes))
    return t


class _Populate:
    """Maps a KV pool's pages in ahead of use (MADV_POPULATE_WRITE, Linux 5.14+), a slice at a
    time on one daemon thread (ctypes lets go of the GIL during the call). Left to the first
    write, each 4 KiB page faulted inside a step: a 448-token chunk's cache writes took 5-6 ms
    of its 125 ms step on SmolLM2, 1.9 ms populated; a 64-row decode step's 1.1-1.7 ms, 0.6."""
    SLICE = 64 << 20
    MADV_POPULATE_WRITE = 23

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def put(self, item: tuple) -> None:
        self.queue.put(item)
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="lane-kv-populate", daemon=True)
                self.thread.start()

    def _run(self) -> None:
        madvise = platform.libc_madvise()
        if madvise is None:
            return
        while True:
            buf, addr, nbytes = self.queue.get()  # (buf keeps the mapping alive meanwhile)
            for off in range(0, nbytes, self.SLICE):
                if madvise(addr + off, min(self.SLICE, nbytes - off), self.MADV_POPULATE_WRITE) != 0:
                    break  # an older kernel (EINVAL): pages fault in on first write, as before
            del buf


_populate = _Populate()


class ModelRunner:
    def __init__(self, model: nn.Module, block_size: int, dtype: torch.dtype, device: torch.device,
                 enable_prefix_caching: bool = True, eos_token_ids: list[int] | None = None,
                 speculative_config: SpeculativeConfig | None = None, max_model_len: int | None = None,
                 kv_cache_dtype: str = "auto") -> None:
        self.model = model
        set_kv_cache_dtype(model, kv_cache_dtype)  # C8: the layers' cache storage, before their specs
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
        self.connector = None  # the KV connector's worker half (PD disaggregation), set by the Worker
        self._state_groups: list[int] = []  # running-state KV cache groups
        self._verify_as_decodes = False
        # speculative decoding (steps 45-47): drafts come from here, with the sampled tokens
        self.spec = speculative_config
        self.max_model_len = max_model_len or 1 << 62
        self.ngram = self.mtp = None
        if speculative_config is not None and speculative_config.method == "ngram":
            self.ngram = NgramProposer(speculative_config.num_speculative_tokens, speculative_config.prompt_lookup_min,
                                       speculative_config.prompt_lookup_max, max_model_len)
        elif speculative_config is not None:
            self.mtp = MtpProposer(model, speculative_config.num_speculative_tokens, self._attn_metadata,
                                   lambda: self._verify_as_decodes)

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
        self._state_groups = [g for g, group in enumerate(kv_cache_config.groups) if group.kind == STATE]
        self._verify_as_decodes = self.spec is not None and all(m.decode_rows_independent
                                                                for m in self.cache_layers.values())

    # -- step 20: inputs ---------------------------------------------------------
    def _attn_metadata(self, common: CommonAttentionMetadata, block_ids: list[tuple[list[int], ...]]) -> list:
        """Each group's metadata, built by the backend from that group's block ids."""
        return [self.attn_backend.build_metadata(group, common, [ids[g] for ids in block_ids])
                for g, group in enumerate(self.kv_cache_config.groups)]

    def _prepare(self, batch: list[ScheduledRequest]):
        """Step 20. When every cache layer's decode rows are independent (paged attention, MLA,
        the indexer), a request verifying drafts is one decode row per token, each seeing the
        cache up to itself, so a verify step stays a decode step (fused kernel included)."""
        # a handed-over prompt's last token runs as a prefill row even alone: only a prefill chunk
        # can give its running state back (the state goes to the decode engine as before that token)
        as_decodes = [(s.is_decode and not self._hands_over(s))
                      or (self._verify_as_decodes and bool(s.drafts) and not s.state.fresh) for s in batch]
        ordered = sorted(zip(as_decodes, batch), key=lambda p: not p[0])  # stable: decode-shaped first
        batch = [s for _, s in ordered]
        input_ids: list[int] = []
        positions: list[int] = []
        layout = BatchLayout()
        takes_back = False
        for as_decode, s in ordered:
            start = s.state.num_computed_tokens
            rows = s.input_ids()
            # rows the step may take back: drafts, or a handed-over prompt's last token (its running
            # state goes to the decode engine as it was before that token)
            back = len(s.drafts) or int(self._hands_over(s))
            takes_back |= back > 0
            layout.add(s.state.block_ids, start, len(rows), as_decode, s.state.fresh, back)
            input_ids.extend(rows)
            positions.extend(range(start, start + s.num_tokens))
        md = self._attn_metadata(layout.common(self.spec is not None or takes_back), layout.block_ids)
        # rows whose token is the request's last pending one, and its drafts': these get logits
        sampling, sample_rows, row = [], [], 0
        for s in batch:
            row += s.num_tokens
            if s.samples:
                sampling.append(s)
                sample_rows.extend(range(row - 1 - len(s.drafts), row))
        return (torch.tensor(input_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                md, sample_rows, sampling, batch)

    def _sampling_metadata(self, sampling: list[ScheduledRequest], so: SchedulerOutput | None = None
                           ) -> SamplingMetadata:
        """One row per sampled position: a request with drafts has one per draft and one
        after them, each seeing the drafts before it as output (penalties, min_tokens). The
        scheduler's grammar bitmask constrains its requests' rows."""
        rows = [(s.state, s.drafts[:j]) for s in sampling for j in range(len(s.drafts) + 1)]
        states = [st for st, _ in rows]
        outputs = [st.output_token_ids + before if before else st.output_token_ids for st, before in rows]
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
        for i, (st, out) in enumerate(zip(states, outputs)):
            p = st.sampling_params
            if len(out) < p.min_tokens:
                stops = p.stop_token_ids + ([] if p.ignore_eos else self.eos_token_ids)
                if stops:
                    md.masked_token_ids[i] = stops
        if any(p.uses_penalties for p in params):
            md.presence_penalty = torch.tensor([p.presence_penalty for p in params])
            md.frequency_penalty = torch.tensor([p.frequency_penalty for p in params])
            md.repetition_penalty = torch.tensor([p.repetition_penalty for p in params])
            md.prompt_token_ids = [st.prompt_token_ids for st in states]
            md.output_token_ids = outputs
        if so is not None and so.grammar_bitmask is not None:
            which = so.structured_output_request_ids
            md.bitmask_rows = [i for i, st in enumerate(states) if st.req_id in which]
            md.bitmask = torch.from_numpy(so.grammar_bitmask[[which[states[i].req_id] for i in md.bitmask_rows]])
        return md

    # -- one step ------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if not so.num_scheduled_tokens:  # a connector-only step: its transfers' news, no forward
            self.connector.bind_connector_metadata(so.kv_connector_metadata)
            self.connector.start_load_kv()
            return ModelRunnerOutput(kv_connector_output=self._save_kv(so))
        prof = tracing.forward_profile()  # None unless tracing
        t0 = time.monotonic() if prof else 0.0
        batch = self.input_batch.update(so)
        input_ids, positions, md, sample_rows, sampling, batch = self._prepare(batch)
        for s in batch:
            s.state.fresh = False
        verifying = [s for s in sampling if s.drafts]
        handing = [s for s in sampling if self._hands_over(s)]  # (before their sampled tokens are appended)
        if prof:
            ids = [s.state.req_id for s in batch]
            nd = sum(s.is_decode for s in batch)
            tracer.record(Step.RUNNER_PREPARE_INPUTS, t0, time.monotonic(), ids, tokens=len(input_ids),
                          decodes=nd, prefill_chunks=len(batch) - nd)
            t_forward = time.monotonic()
            prof.begin()
        if self.connector is not None:  # step 55: blocks another engine computed, before they are read
            self.connector.bind_connector_metadata(so.kv_connector_metadata)
            self.connector.start_load_kv()
        # sequence parallelism only where a prompt chunk brings rows to share out
        sequence_parallel_step(any(not s.is_decode and not s.drafts for s in batch))
        with set_forward_context(md):
            hidden = self.model(input_ids, positions)
        kv_out = self._save_kv(so) if self.connector is not None else None
        if not sample_rows and self.mtp is None:
            if prof:
                prof.emit(ids, self.num_layers, self.attention_attrs)
            return ModelRunnerOutput(kv_connector_output=kv_out)
        logits = self.model.compute_logits(hidden[sample_rows]) if sample_rows else None  # step 32
        if prof:
            prof.mark(Step.MODEL_LM_HEAD)
            prof.emit(ids, self.num_layers, self.attention_attrs)
            if verifying:  # step 46: the forward that scored the drafts
                tracer.record(Step.MODEL_VERIFY, t_forward, time.monotonic(), [s.state.req_id for s in verifying],
                              drafts=sum(len(s.drafts) for s in verifying), requests=len(verifying))
            t_sample = time.monotonic()
        if verifying:
            tokens, logprobs = self._verify(logits, sampling, so)  # step 47
            if prof:
                tracer.record(Step.RUNNER_REJECTION_SAMPLE, t_sample, time.monotonic(),
                              [s.state.req_id for s in verifying], drafts=sum(len(s.drafts) for s in verifying),
                              accepted=sum(len(t) - 1 for s, t in zip(sampling, tokens) if s.drafts))
        elif sampling:
            out = sample(logits, self._sampling_metadata(sampling, so))  # step 34
            tokens = [[tok] for tok in out.token_ids]
            logprobs = [[lp] if lp is not None else None for lp in out.logprobs]
        else:
            tokens, logprobs = [], []
        if prof and sampling:
            tracer.record(Step.RUNNER_SAMPLE, t_sample, time.monotonic(), [s.state.req_id for s in sampling],
                          rows=len(sample_rows), greedy=all(s.state.sampling_params.greedy for s in sampling))
        for s, toks in zip(sampling, tokens):
            for tok in toks:
                s.state.append_output_token(tok)
        if verifying or handing:
            self._keep_verified(sampling, tokens, handing)
        drafts = self._propose(batch, sampling, tokens, hidden) if self.spec else None
        return ModelRunnerOutput([s.state.req_id for s in sampling], tokens,
                                 logprobs if any(lp is not None for lp in logprobs) else None,
                                 drafts, kv_connector_output=kv_out)

    def _save_kv(self, so: SchedulerOutput):
        """After the forward: the connector's saves, and what its transfers finished."""
        self.connector.wait_for_save()
        out = self.connector.take_output(set(so.finished_req_ids))
        self.connector.bind_connector_metadata(None)
        return out

    # -- speculative decoding ---------------------------------------------------------
    def _verify(self, logits: torch.Tensor, sampling: list[ScheduledRequest], so: SchedulerOutput
                ) -> tuple[list, list]:
        """Step 47: each request's accepted drafts and one token from the target, from the
        distribution the sampler would use at each position (penalties, masks, temperature,
        top-k / top-p / min-p). Logprobs are the raw model's, as the sampler's."""
        md = self._sampling_metadata(sampling, so)
        nums = md.num_logprobs
        raw = logits.float().log_softmax(dim=-1) if any(n is not None for n in nums) else None  # before masks
        greedy_ids, probs = target_distribution(logits, md)
        first = [0]
        for s in sampling:
            first.append(first[-1] + len(s.drafts) + 1)
        tokens: list[list[int]] = [[] for _ in sampling]
        greedy = [b for b, s in enumerate(sampling) if s.state.sampling_params.greedy]
        random = [b for b, s in enumerate(sampling) if not s.state.sampling_params.greedy]
        for group, is_greedy in ((greedy, True), (random, False)):
            if not group:
                continue
            k = max(len(sampling[b].drafts) for b in group)
            rows = torch.tensor([[first[b] + min(j, len(sampling[b].drafts)) for j in range(k + 1)] for b in group])
            draft_ids = torch.tensor([sampling[b].drafts + [0] * (k - len(sampling[b].drafts)) for b in group],
                                     dtype=torch.long)
            n = [len(sampling[b].drafts) for b in group]
            if is_greedy:
                out = rejection_sample(draft_ids, greedy_ids[rows], num_drafts=n, greedy=True)
            else:
                q = None
                if self.mtp is not None and k:
                    V = probs.shape[-1]
                    q = torch.zeros(len(group), k, V)
                    for i, b in enumerate(group):
                        st = sampling[b].state
                        if n[i] and st.draft_probs is not None:
                            q[i, :n[i]] = st.draft_probs[:n[i]]
                        elif n[i]:  # drafted greedily (a temperature set since): one-hot
                            q[i, torch.arange(n[i]), draft_ids[i, :n[i]]] = 1.0
                out = rejection_sample(draft_ids, probs[rows], q, n, generators=[sampling[b].state.generator
                                                                                  for b in group])
            for b, toks in zip(group, out):
                tokens[b] = toks
        logprobs: list = [None] * len(sampling)
        if raw is not None:
            for b, toks in enumerate(tokens):
                if nums[first[b]] is not None:
                    rows = list(range(first[b], first[b] + len(toks)))
                    logprobs[b] = token_logprobs(raw[rows], toks, nums[first[b]:first[b] + len(toks)])
        return tokens, logprobs

    def _hands_over(self, s: ScheduledRequest) -> bool:
        """This step ends the prompt of a request whose KV, running state included, a decode
        engine pulls (PD disaggregation)."""
        return bool(self._state_groups) and s.state.sampling_params.hands_over_kv and s.samples and not s.drafts

    def _keep_verified(self, sampling: list[ScheduledRequest], tokens: list[list[int]],
                       handing: list[ScheduledRequest] = ()) -> None:
        """Running state (V4's compression) falls back to the last accepted position (and, for a
        request handed over to a decode engine, to before its last prompt token)."""
        if not self._state_groups:
            return
        rows: dict[int, int] = {}  # running-state slot -> rows of this step it keeps
        for s, toks in zip(sampling, tokens):
            if s.drafts and (rejected := len(s.drafts) + 1 - len(toks)):
                for g in self._state_groups:
                    rows[s.state.block_ids[g][0]] = s.num_tokens - rejected
            elif any(h is s for h in handing):
                for g in self._state_groups:
                    rows[s.state.block_ids[g][0]] = s.num_tokens - 1
        for layer in self.cache_layers.values():
            layer.keep_verified(rows)

    def _num_drafts(self, st: CachedRequestState) -> int:
        """Drafts worth proposing: k, but none past max_model_len or the request's max_tokens
        (a step yields at most drafts + 1 tokens)."""
        left = (st.sampling_params.max_tokens or 1 << 62) - len(st.output_token_ids)
        return max(0, min(self.spec.num_speculative_tokens, self.max_model_len - st.num_tokens, left - 1))

    def _propose(self, batch: list[ScheduledRequest], sampling: list[ScheduledRequest],
                 tokens: list[list[int]], hidden: torch.Tensor) -> list[list[int]]:
        """Step 45: the next step's drafts for every request that sampled (same order)."""
        t0 = time.monotonic() if tracer.enabled else 0.0
        out: list[list[int]] = [[] for _ in sampling]
        if self.ngram is not None:
            for b, s in enumerate(sampling):
                if n := self._num_drafts(s.state):
                    out[b] = self.ngram.propose(s.state.token_ids)[:n]
        else:
            kept = {s.state.req_id: len(t) for s, t in zip(sampling, tokens)}
            plan, row = [], 0
            for s in batch:
                st = s.state
                n_rows = s.num_tokens
                if s.drafts:  # the pending token and the accepted drafts
                    n_rows = s.num_tokens - len(s.drafts) - 1 + kept[st.req_id]
                plan.append(MtpRows(s, row, n_rows, self._num_drafts(st) if st.req_id in kept else 0))
                row += s.num_tokens
            drafted = self.mtp.propose(plan, hidden)
            for b, s in enumerate(sampling):
                toks, q = drafted.get(s.state.req_id, ([], None))
                out[b], s.state.draft_probs = toks, q
        if tracer.enabled and sampling:
            tracer.record(Step.MODEL_MTP_DRAFT, t0, time.monotonic(), [s.state.req_id for s in sampling],
                          method=self.spec.method, drafts=sum(map(len, out)),
                          requests=sum(1 for d in out if d))
        return out

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int, null_block: bool = False) -> None:
        """One prefill-shaped forward of a request in blocks (and state slot) 1.., not yet
        handed out (at start-up), or of up to a block's tokens in the null block 0, which no
        request's attention reads (while serving); their cache entries are zeroed again after."""
        bs = self.block_size
        num_blocks = -(-num_tokens // bs)
        first = 0 if null_block else 1
        assert not null_block or num_blocks == 1, "the null block holds one block's tokens"
        common = CommonAttentionMetadata(0, [0], [num_tokens], [0], [True])
        ids = tuple([first] if g.kind == STATE else list(range(first, first + num_blocks))
                    for g in self.kv_cache_config.groups)
        sequence_parallel_step(True)  # prefill-shaped
        with set_forward_context(self._attn_metadata(common, [ids])):
            pos = torch.arange(num_tokens)
            self.model.compute_logits(self.model(torch.zeros(num_tokens, dtype=torch.long), pos)[-1:])
        for t in self.kv_caches.values():
            t[first:first + num_blocks].zero_()

"""The runner's own per-request state (vLLM's ``CachedRequestState`` / ``InputBatch``),
kept from nothing but ``SchedulerOutput``s: token ids (the prompt, then what it
sampled), block ids per KV cache group (a running-state group's is the request's
slot), computed tokens, sampling parameters and each seeded request's generator."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lane.core.scheduler_output import SchedulerOutput
from lane.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    generator: torch.Generator | None = None  # a seeded request draws from its own, whatever its batch
    output_token_ids: list[int] = field(default_factory=list)
    fresh: bool = True  # its next chunk is the first since (re)admission: running state starts anew
    draft_probs: torch.Tensor | None = None  # [drafts, V]: the MTP's q of its sampled drafts

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)  # prompt + output

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.token_ids.append(token_id)


@dataclass
class ScheduledRequest:
    """One request of this step's batch."""
    state: CachedRequestState
    num_tokens: int  # computed for it this step, drafts included
    drafts: list[int] = field(default_factory=list)  # to verify: the last len(drafts) of its tokens

    @property
    def is_decode(self) -> bool:
        """One token after the first chunk: batched with the other decodes."""
        return self.num_tokens == 1 and not self.state.fresh

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last token (so a token is sampled)."""
        return self.state.num_computed_tokens + self.num_tokens == self.state.num_tokens + len(self.drafts)

    def input_ids(self) -> list[int]:
        st = self.state
        ids = st.token_ids[st.num_computed_tokens:st.num_computed_tokens + self.num_tokens]
        return ids + self.drafts if self.drafts else ids


class InputBatch:
    def __init__(self) -> None:
        self.requests: dict[str, CachedRequestState] = {}

    def update(self, so: SchedulerOutput) -> list[ScheduledRequest]:
        """Apply one scheduler output; returns this step's requests, decodes first (in
        scheduling order), then prefill chunks."""
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for rid in so.preempted_req_ids:  # blocks gone; it comes back resumed
            if (st := self.requests.get(rid)) is not None:
                st.block_ids = tuple([] for _ in st.block_ids)
                st.num_computed_tokens = 0
        for new in so.scheduled_new_reqs:
            sp = new.sampling_params
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.prompt_token_ids), sp, tuple(list(ids) for ids in new.block_ids),
                new.num_computed_tokens,
                torch.Generator().manual_seed(sp.seed) if sp.seed is not None else None,
                fresh=not new.state_arrived)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self.requests[rid]
            st.num_computed_tokens = cached.num_computed_tokens[i]
            new_ids = cached.new_block_ids[i]
            if cached.resumed_from_preemption[i]:
                st.block_ids, st.fresh = tuple(list(ids) for ids in new_ids), True
            elif cached.block_ids_replaced and cached.block_ids_replaced[i]:
                st.block_ids = tuple(list(ids) for ids in new_ids)
            elif new_ids is not None:
                for table, ids in zip(st.block_ids, new_ids):
                    table.extend(ids)
        spec = so.scheduled_spec_decode_tokens
        batch = [ScheduledRequest(self.requests[rid], n, spec.get(rid, []))
                 for rid, n in so.num_scheduled_tokens.items()]
        return sorted(batch, key=lambda s: not s.is_decode)  # stable: decodes first, in order

"""What the scheduler hands the workers each step (vLLM's ``core/sched/output.py``): plain
data that msgspec encodes, so a worker in another process (or machine) runs from it
alone. Requests the workers have not seen come whole (``NewRequestData``); the rest
come as what changed (``CachedRequestData``). Block ids are one list per KV cache group.
The workers keep each request's tokens themselves (they sampled them)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lane.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]  # per group
    num_computed_tokens: int  # prefix-cache hit: tokens whose cache entries exist already
    state_arrived: bool = False  # PD: another engine sent its running state; it goes on from it


@dataclass
class CachedRequestData:
    """Requests the workers hold, as parallel lists (one entry per request)."""
    req_ids: list[str] = field(default_factory=list)
    # back after a preemption: its blocks are new (new_block_ids replace the old ones)
    # and its running state starts anew
    resumed_from_preemption: list[bool] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)  # per group, appended
    num_computed_tokens: list[int] = field(default_factory=list)
    # the tables were cut back (rejected drafts' blocks given back): new_block_ids are the whole tables
    block_ids_replaced: list[bool] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # req id -> tokens this step
    total_num_scheduled_tokens: int = 0
    # finished (or aborted) since the last output: the workers drop their state
    finished_req_ids: list[str] = field(default_factory=list)
    # preempted this step: their blocks are gone, they come back as resumed
    preempted_req_ids: list[str] = field(default_factory=list)
    # req id -> draft tokens scheduled (after its pending tokens) to be verified this step
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # structured outputs: req id -> its row of grammar_bitmask ([rows, ceil(V / 32)] int32 numpy
    # array: the tokens each constrained request that samples this step may sample)
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: Any = None
    # PD disaggregation: what the workers' KV connector loads and saves this step (its own data class)
    kv_connector_metadata: Any = None

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

"""A request as the engine core sees it: token ids, progress, blocks."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from lane.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    WAITING_FOR_REMOTE_KVS = 3  # admitted with blocks; another engine's KV is arriving in them
    FINISHED_STOPPED = 4
    FINISHED_LENGTH_CAPPED = 5
    FINISHED_ABORTED = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop",
                RequestStatus.FINISHED_LENGTH_CAPPED: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


@dataclass(eq=False)  # one object per request: the scheduler's list.remove / `in` compare by identity
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # prompt + output; the scheduler's only notion of progress is how many of
    # these already have K/V in the cache (num_computed_tokens)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first schedule (-1: not yet)
    num_preemptions: int = 0
    scheduled_ts: float = 0.0  # monotonic time it was first scheduled
    num_chunks: int = 0  # prefill slices after the first (for traces)
    stop_reason: int | str | None = None
    # chained hashes of this request's full blocks, grown as tokens arrive
    block_hashes: list[bytes] = field(default_factory=list)
    # drafts proposed by the last step, scheduled (and verified) in the next one; never in
    # all_token_ids, whose tokens are all verified
    spec_token_ids: list[int] = field(default_factory=list)
    blocks_trimmed: bool = False  # blocks given back since the workers last saw its tables
    kv_state_arrived: bool = False  # another engine sent its running state (it resumes from it, not anew)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def kv_transfer_params(self) -> dict | None:
        return self.sampling_params.kv_transfer_params

    @property
    def hands_over_kv(self) -> bool:
        return self.sampling_params.hands_over_kv

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens or 1 << 62

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

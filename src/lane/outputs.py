"""What the engine hands back to users (vLLM's RequestOutput / CompletionOutput)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lane.kv_transfer.base import KVConnectorOutput
    from lane.metrics.stats import EplbStats


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


# one dict per generated position: token id -> Logprob (the sampled token and the top-N)
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    kv_transfer_params: dict | None = None  # PD disaggregation: for the engine that goes on with it


@dataclass
class ModelRunnerOutput:
    """What the model runner returns for one step (vLLM's name): per request that reached
    its last pending token, the tokens it sampled (more than one when drafts were accepted)
    and, when asked for, their logprobs
    (per token: (logprob, rank, [(token_id, logprob), ...]))."""
    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[tuple] | None] | None = None
    # speculative decoding: each sampled request's drafts for its next step (same order)
    spec_token_ids: list[list[int]] | None = None
    eplb_stats: "EplbStats | None" = None  # --enable-eplb: the workers' EPLB figures, when they changed
    kv_connector_output: "KVConnectorOutput | None" = None  # PD disaggregation: what transfers did

    @property
    def req_id_to_index(self) -> dict[str, int]:
        return {rid: i for i, rid in enumerate(self.req_ids)}

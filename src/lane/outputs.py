"""What the engine hands back to users (vLLM's RequestOutput / CompletionOutput)."""
from __future__ import annotations

from dataclasses import dataclass, field


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

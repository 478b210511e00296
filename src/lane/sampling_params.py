"""SamplingParams, with vLLM's names and limits."""
from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGPROBS = 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what crosses to the engine must fit its int64 tensors


class ParamError(ValueError):
    """A bad request parameter; ``param`` names it (the API's error body and the CLI's
    flag name come from it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's ``StructuredOutputsParams``): exactly one of a JSON
    schema (JSON text), a regex, a list of choices, an EBNF grammar, or any JSON object."""
    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    # the constraint starts after these tokens (a reasoning parser's end of thinking, e.g.
    # </think>): the reasoning is free text. None: from the first token
    reasoning_end: list[int] | None = None

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            import json

            self.json = json.dumps(self.json)
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ParamError("structured_outputs", "structured outputs take exactly one of json, regex, choice, "
                                                   f"grammar, json_object; got {given or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ParamError("structured_outputs", "choice must be a non-empty list of non-empty strings")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec): what a compiled grammar is cached by."""
        if self.json_object:
            return "json_object", ""
        if self.choice is not None:
            import json

            return "choice", json.dumps(self.choice)
        kind = next(k for k in ("json", "regex", "grammar") if getattr(self, k) is not None)
        return kind, getattr(self, kind)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives besides the sampled token
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's extra_args: {"kv_transfer_params": {...}} is what PD disaggregation's connectors read
    extra_args: dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._verify()

    def _verify(self) -> None:
        def bad(name: str, msg: str, value) -> ParamError:
            return ParamError(name, f"{name} {msg}, got {value!r}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be at least 1", self.n)
        # NaN passes every range check below (all comparisons are false), and JSON
        # bodies may carry NaN and Infinity
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise bad(name, "must be a finite number", getattr(self, name))
        if self.temperature < 0:
            raise bad("temperature", "must be non-negative", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]", self.top_p)
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= INT64_MAX:
            raise bad("top_k", f"must be -1 or 0 (disable), or in [1, {INT64_MAX}]", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]", self.min_p)
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]", self.presence_penalty)
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]", self.frequency_penalty)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise bad("repetition_penalty", "must be in (0, 2]", self.repetition_penalty)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "must be at least 1", self.max_tokens)
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", "must be in [0, max_tokens]", self.min_tokens)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}]", self.logprobs)
        if self.seed is not None and (not isinstance(self.seed, int) or not INT64_MIN <= self.seed <= INT64_MAX):
            raise bad("seed", f"must be an integer in [{INT64_MIN}, {INT64_MAX}]", self.seed)
        if any(not s for s in self.stop):
            raise bad("stop", "must not contain empty strings", self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def kv_transfer_params(self) -> dict | None:
        """PD disaggregation: what the other engine said of this request's KV (or asks of it)."""
        return self.extra_args.get("kv_transfer_params") if self.extra_args else None

    @property
    def hands_over_kv(self) -> bool:
        """A prefill engine's request whose KV a decode engine pulls (do_remote_decode)."""
        params = self.kv_transfer_params
        return bool(params and params.get("do_remote_decode"))

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def for_child(self, index: int) -> "SamplingParams":
        """Params of the index-th of n samples: one sample each, distinct seeds."""
        from dataclasses import replace

        # distinct seeds, wrapped to stay 64-bit signed
        seed = None if self.seed is None else (self.seed + index + 2**63) % 2**64 - 2**63
        return replace(self, n=1, seed=seed)

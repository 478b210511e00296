"""Frontend input processing (vLLM's Processor): prompts and chat messages to token
ids, checked against the model before anything reaches an engine (seed steps 10-12)."""
from __future__ import annotations

from typing import Any

from lane.config import ModelConfig
from lane.sampling_params import ParamError, SamplingParams

PromptType = str | dict[str, Any]


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = model_config.max_model_len
        self.vocab_size = model_config.hf_config.vocab_size

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """A prompt is a string, {"prompt": str} or {"prompt_token_ids": [...]}."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise TypeError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            chat_template: str | None = None, tools: list[dict] | None = None,
                            chat_template_kwargs: dict | None = None) -> list[int]:
        """The conversation rendered by the chat template (the model's, or one given), with
        the tools the request offers, then tokenized."""
        if not messages:
            raise ParamError("messages", "messages must not be empty")
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=chat_template, tools=tools, **(chat_template_kwargs or {}))
        return self.tokenizer.encode(text, add_special_tokens=False)

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        if not all(0 <= t < self.vocab_size for t in token_ids):
            raise ParamError(param, f"{param}: token ids must lie in [0, {self.vocab_size})")

    def validate(self, prompt_token_ids: list[int], params: SamplingParams,
                 strict_max_tokens: bool = False) -> None:
        """Raise ParamError for a prompt the engine cannot serve. With strict_max_tokens
        (the API server, as vLLM's), max_tokens past the context is an error; offline it
        is simply capped at the context."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ParamError("prompt", "the prompt is empty")
        if n > self.max_model_len:
            raise ParamError("prompt", f"the prompt has {n} tokens, longer than the maximum "
                                       f"model length of {self.max_model_len}")
        self.check_token_ids(prompt_token_ids, "prompt")
        # the sampler masks them before min_tokens: they must index the vocabulary
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        if params.structured_outputs is not None:  # a grammar that does not build fails here, not in the engine
            from lane.structured_output import check

            check(params.structured_outputs)
        if strict_max_tokens and params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ParamError("max_tokens", (
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} in "
                f"the completion). Please reduce the length of the prompt or max_tokens."))

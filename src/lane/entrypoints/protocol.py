"""OpenAI API request and response schemas (pydantic), with vLLM's extensions
(top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids, data_parallel_rank...)."""
from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from lane.sampling_params import (INT64_MAX, INT64_MIN, MAX_LOGPROBS, ParamError, SamplingParams,
                                  StructuredOutputsParams)

# The request fields' ranges are declared here too, so /openapi.json tells clients (and
# schema fuzzers) what is valid; SamplingParams and the InputProcessor check the rest (the
# vocabulary, the context length) and every offline request.
TOKEN_ID_MARK = "x-lane-token-id"  # the API server's schema turns it into [0, vocabulary size)
TokenId = Annotated[int, Field(json_schema_extra={TOKEN_ID_MARK: True})]


class OpenAIBaseModel(BaseModel):
    # unknown fields are ignored, as OpenAI and vLLM do
    model_config = ConfigDict(extra="ignore")


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class JsonSchemaFormat(OpenAIBaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(OpenAIBaseModel):
    """vLLM's ``structured_outputs`` request field: exactly one of these."""
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


# the request's nested objects whose unknown keys are named too ("structured_outputs.whitespace_pattern")
NESTED_FIELDS = {"response_format": ResponseFormat, "structured_outputs": StructuredOutputs,
                 "stream_options": StreamOptions, "json_schema": JsonSchemaFormat}


def _unknown_keys(model: type[BaseModel], data: dict, prefix: str) -> list[str]:
    known = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
    out = []
    for k, v in data.items():
        if k not in known:
            out.append(prefix + k)
        elif k in NESTED_FIELDS and isinstance(v, dict):
            out += _unknown_keys(NESTED_FIELDS[k], v, f"{prefix}{k}.")
    return out


class SamplingRequest(OpenAIBaseModel):
    """Fields common to completions and chat completions. Top-level fields lane does not
    implement are ignored, not silently: they are kept in ``ignored_fields`` (the server logs
    and counts them)."""
    _ignored_fields: list[str] = PrivateAttr(default_factory=list)

    @model_validator(mode="wrap")
    @classmethod
    def _note_ignored_fields(cls, data: Any, handler):
        request = handler(data)
        if isinstance(data, dict):
            ignored = _unknown_keys(cls, data, "")
            rf = data.get("response_format")
            js = rf.get("json_schema") if isinstance(rf, dict) else None
            if isinstance(js, dict) and js.get("strict") is False:  # every schema is enforced strictly
                ignored.append("response_format.json_schema.strict")
            request._ignored_fields = sorted(ignored)
        return request

    @property
    def ignored_fields(self) -> list[str]:
        return self._ignored_fields

    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # logprobs name each token "token_id:<id>" (vLLM's), e.g. to check ids against a reference
    return_tokens_as_token_ids: bool = False
    data_parallel_rank: int | None = Field(None, ge=0)
    # PD disaggregation (vLLM's): do_remote_decode / do_remote_prefill, remote_block_ids, ...
    kv_transfer_params: dict[str, Any] | None = None
    return_timing: bool = False  # lane's extension: queue / prefill / decode / TTFT / mean ITL in ms
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and older guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one constraint the request asks for, checked (a bad schema, regex or grammar is a
        ParamError naming its field), or None."""
        from lane.structured_output import check

        given: list[tuple[str, dict]] = self._tool_constraint()
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ParamError("response_format", "response_format of type json_schema needs json_schema.schema")
            given.append(("response_format", {"json": rf.json_schema.schema_}))
        if (so := self.structured_outputs) is not None:
            fields = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                      "json_object": bool(so.json_object)}
            given.append(("structured_outputs", {k: v for k, v in fields.items() if v not in (None, False)}))
        for name in ("json", "regex", "choice", "grammar"):
            if (v := getattr(self, f"guided_{name}")) is not None:
                given.append((f"guided_{name}", {name: v}))
        if not given:
            return None
        if len(given) > 1:
            raise ParamError(given[1][0], f"only one structured output constraint per request "
                                          f"(got {', '.join(p for p, _ in given)})")
        param, fields = given[0]
        try:
            params = StructuredOutputsParams(**fields)
        except ParamError as e:
            raise ParamError(param, str(e)) from None
        check(params, param)  # refused here, before any compute
        return params

    def _tool_constraint(self) -> list[tuple[str, dict]]:
        return []

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed when stream is true")
        if self.kv_transfer_params:
            check_kv_transfer_params(self.kv_transfer_params)
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, seed=self.seed, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured_outputs_params(),
            extra_args={"kv_transfer_params": self.kv_transfer_params} if self.kv_transfer_params else None)


def check_kv_transfer_params(p: dict) -> None:
    """A decode engine acts on these (it pulls blocks by them): their shape is checked here, a
    bad one is a 400, never an engine error."""
    def bad(msg: str) -> ParamError:
        return ParamError("kv_transfer_params", f"kv_transfer_params: {msg}")

    for key in ("do_remote_decode", "do_remote_prefill"):
        if key in p and not isinstance(p[key], bool):
            raise bad(f"{key} must be true or false")
    if not p.get("do_remote_prefill"):
        return
    ids = p.get("remote_block_ids")
    if not (isinstance(ids, list) and ids and all(isinstance(g, list) and all(type(b) is int and b >= 0 for b in g)
                                                  for g in ids)):
        raise bad("remote_block_ids must be a list of lists of block ids (one per KV cache group)")
    for key, kind in (("remote_host", str), ("remote_request_id", str)):
        if not isinstance(p.get(key), kind) or not p[key]:
            raise bad(f"{key} must be a non-empty string")
    port = p.get("remote_port")
    if type(port) is not int or not 0 < port < 65536:
        raise bad("remote_port must be a port number")
    tp = p.get("tp_size", 1)
    if type(tp) is not int or tp < 1:
        raise bad("tp_size must be an integer >= 1")


class CompletionRequest(SamplingRequest):
    # documented, not enforced here: in a union pydantic would report every branch's error;
    # the InputProcessor names what is wrong (empty, out of the vocabulary, too long)
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        json_schema_extra={"minLength": 1, "minItems": 1})
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True

    def to_sampling_params(self, max_model_len: int, num_prompt_tokens: int) -> SamplingParams:
        if self.suffix is not None:
            raise ParamError("suffix", "suffix is not supported")
        max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = max(max_model_len - num_prompt_tokens, 1)
        return self._sampling_params(max_tokens, self.logprobs)


class ContentPart(OpenAIBaseModel):
    type: str = Field(json_schema_extra={"enum": ["text"]})  # others are refused with a message
    text: str | None = None


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallItem(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's earlier reasoning (vLLM's field)

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ParamError("messages", f"content parts of type {part.type!r} are not supported "
                                             f"(only 'text')")
            parts.append(part.text)
        return "\n".join(parts)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. DeepSeek's {"thinking": true}
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as chat templates read them: an assistant's tool calls carry their
        arguments as objects (templates write them with ``tojson``)."""
        if not self.messages:
            raise ParamError("messages", "messages must not be empty")
        out = []
        for i, m in enumerate(self.messages):
            msg: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.reasoning_content is not None:
                msg["reasoning_content"] = m.reasoning_content
            if m.tool_calls:
                calls = []
                for tc in m.tool_calls:
                    try:
                        args = json.loads(tc.function.arguments)
                    except ValueError:
                        raise ParamError("messages", f"messages[{i}].tool_calls: the arguments of "
                                                     f"{tc.function.name!r} are not JSON") from None
                    calls.append({"id": tc.id, "type": "function",
                                  "function": {"name": tc.function.name, "arguments": args}})
                msg["tool_calls"] = calls
            out.append(msg)
        return out

    def tool_dicts(self) -> list[dict] | None:
        """The tools as chat templates read them (None: no tools). As in vLLM, tool_choice
        none still shows them to the template; only the output is not parsed for calls."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def _tool_constraint(self) -> list[tuple[str, dict]]:
        _, schema = self.forced_tool_schema()
        return [] if schema is None else [("tool_choice", {"json": schema})]

    def forced_tool_schema(self) -> tuple[str | None, dict | None]:
        """tool_choice required or a named function: (the name or None for required, the JSON
        schema its output must match); (None, None) otherwise."""
        from lane.entrypoints.tool_parsers import required_schema

        choice = self.tool_choice
        if choice is None or choice in ("none", "auto"):
            return None, None
        if not self.tools:
            raise ParamError("tool_choice", f"tool_choice {_choice_name(choice)} needs tools")
        functions = [t.function for t in self.tools]
        if isinstance(choice, NamedToolChoice):
            f = next((f for f in functions if f.name == choice.function.name), None)
            if f is None:
                raise ParamError("tool_choice", f"tool_choice names {choice.function.name!r}, which is not "
                                                f"among the tools ({', '.join(f.name for f in functions)})")
            return f.name, f.parameters or {"type": "object"}
        return None, required_schema([f.model_dump(exclude_none=True) for f in functions], self.parallel_tool_calls)

    def to_sampling_params(self, max_model_len: int, num_prompt_tokens: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs requires logprobs to be true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is None:
            max_tokens = max(max_model_len - num_prompt_tokens, 1)
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


def _choice_name(choice) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


# -- responses -------------------------------------------------------------------

class CompletionLogprobs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict | None = None  # PD disaggregation: for the decode engine (vLLM's field)


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIBaseModel):
    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallItem] = Field(default_factory=list)


class ChatChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    kv_transfer_params: dict | None = None


class ChatCompletionChunk(OpenAIBaseModel):
    """The envelope of a streamed chunk (its choices are built as plain dicts: hot path)."""
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[dict] = Field(default_factory=list)
    usage: UsageInfo | None = None


# -- the other endpoints -------------------------------------------------------

class TokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    # with messages, as a chat completion renders them (vLLM's /tokenize takes the same)
    tools: list[ChatCompletionTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[TokenId]


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "lane"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(exclude_none=False)

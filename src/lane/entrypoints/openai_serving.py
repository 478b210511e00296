"""The OpenAI completions and chat completions handlers (seed steps 10-12, 38-40, 50):
request -> token ids and SamplingParams -> AsyncLLM -> JSON or SSE chunks."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from lane.engine.async_llm import AsyncLLM, RequestStream
from lane.engine.core_client import EngineBusyError, EngineDeadError
from lane.engine.dp_balancer import EngineOverloadedError
from lane.entrypoints.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                       ChatCompletionResponse, ChatLogprobs, ChatLogprobToken,
                                       ChatResponseMessage, CompletionChoice,
                                       CompletionLogprobs, CompletionRequest, CompletionResponse,
                                       ErrorInfo, ErrorResponse, FunctionCall, SamplingRequest,
                                       ToolCallItem, TopLogprob, UsageInfo)
from lane.entrypoints.tool_parsers import (REASONING_PARSERS, TOOL_PARSERS, NamedToolParser,
                                           RequiredToolParser)
from lane.entrypoints.tool_parsers.chat_output import ChatOutputParser
from lane.entrypoints.tool_parsers.types import DeltaMessage
from lane.outputs import CompletionOutput, RequestOutput
from lane.sampling_params import ParamError, SamplingParams
from lane.tracing import Step, tracer

logger = logging.getLogger(__name__)


class APIError(Exception):
    """An error that becomes an OpenAI-style error body with this status."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message, self.type, self.param), self.status,
                            headers=self.headers)


def error_body(status: int, message: str, type_: str, param: str | None = None) -> dict:
    return ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=status)).model_dump()


def bad_request(e: ValueError) -> APIError:
    return APIError(400, str(e), "BadRequestError", getattr(e, "param", None))


# seconds an overloaded server asks a refused client to wait: about how long a queue
# of short requests takes to move on; clients back off further on repeated refusals
RETRY_AFTER_S = 1


def engine_error(e: Exception) -> APIError:
    """A request that was running when its engine failed."""
    return APIError(500, str(e), "InternalServerError")


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


class ChunkEncoder:
    """A stream's SSE chunks, sse({**base, "choices": choices, **extra}) byte for byte, with the
    envelope (id, object, created, model) encoded once per stream, not once per token."""

    def __init__(self, base: dict) -> None:
        head = {k: v for k, v in base.items() if k != "choices"}
        self.exact = list(base)[-1:] == ["choices"]  # else the keys' order differs: sse() it is
        self.base = base
        self.prefix = f"data: {_dumps(head)[:-1]},\"choices\":" if head else 'data: {"choices":'

    def __call__(self, choices: list, extra: dict | None = None) -> str:
        if not self.exact:
            return sse({**self.base, "choices": choices, **(extra or {})})
        if extra:
            return f"{self.prefix}{_dumps(choices)},{_dumps(extra)[1:]}\n\n"
        return f"{self.prefix}{_dumps(choices)}}}\n\n"


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs (a completion with a list of prompts)."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in it:
                q.put_nowait((i, out))
            q.put_nowait((i, done))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            q.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def until_disconnected(raw_request: Request, work: Awaitable):
    """Run work, unless the client goes away first (then it is cancelled, which aborts
    its requests and frees their KV blocks); returns None in that case."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await raw_request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():  # the client left (or this handler was cancelled)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return task.result() if not task.cancelled() else None


_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_id_of(raw_request: Request) -> str:
    """The client's X-Request-Id (a proxy sends one id with both legs of a disaggregated request,
    so the two engines' traces join), else a fresh one. Only letters, digits and ._:- (at most
    128): it names the request in logs and trace URLs."""
    given = raw_request.headers.get("x-request-id")
    if given is None:
        return uuid.uuid4().hex
    if not _REQUEST_ID.fullmatch(given):
        raise APIError(400, "X-Request-Id must be 1-128 letters, digits or ._:- characters", "BadRequestError",
                       "X-Request-Id")
    return given


def trace_chunk(request_id: str, start: float, index: int, choices: int) -> None:
    """Step 39 (the first SSE chunk with tokens, its text possibly empty) or 50 (a later delta)."""
    if tracer.enabled:
        tracer.record(Step.API_STREAM if index == 0 else 50, start, time.monotonic(), [request_id], chunk=index,
                      choices=choices)


@dataclass
class ChatOptions:
    """The chat route's server flags, as vLLM spells them."""
    chat_template: str | None = None  # --chat-template (its text): replaces the model's
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # a TOOL_PARSERS name
    reasoning_parser: str | None = None  # a REASONING_PARSERS name


def _in_tail(seq: list[int], sub: list[int], slack: int) -> bool:
    """Whether sub occurs within the last len(sub) + slack items of seq (only the tail is read:
    prompts can be long)."""
    n = len(sub)
    tail = seq[-(n + slack):]
    return n > 0 and any(tail[i:i + n] == sub for i in range(len(tail) - n + 1))


def _delta_dict(d: DeltaMessage) -> dict:
    out: dict[str, Any] = {}
    if d.reasoning_content:
        out["reasoning_content"] = d.reasoning_content
    if d.content:
        out["content"] = d.content
    if d.tool_calls:
        tcs = []
        for tc in d.tool_calls:  # OpenAI's shape: id, type and name in a call's first delta only
            item: dict[str, Any] = {"index": tc.index, "function": {"arguments": tc.arguments}}
            if tc.name is not None:
                item.update(id=tc.id, type="function")
                item["function"]["name"] = tc.name
            tcs.append(item)
        out["tool_calls"] = tcs
    return out


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str], chat: ChatOptions | None = None) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.tokenizer = engine.tokenizer
        self.chat = chat or ChatOptions()

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    def _params(self, ids: list[int], request: SamplingRequest,
                adjust: Callable[[list[int], SamplingParams], SamplingParams] | None = None) -> SamplingParams:
        params = request.to_sampling_params(self.engine.max_model_len, len(ids))
        if adjust is not None:
            params = adjust(ids, params)
        self.engine.processor.validate(ids, params, strict_max_tokens=True)
        return params

    def _start(self, prefix: str, prompts: list[tuple[str | None, list[int]]], request: SamplingRequest,
               raw_request: Request, t_entry: float,
               adjust: Callable[[list[int], SamplingParams], SamplingParams] | None = None,
               ) -> tuple[str, list[RequestStream], int]:
        """Validate every prompt, then send them; returns (response id, handles, n)."""
        if request.ignored_fields:  # as vLLM: said, not silently dropped
            logger.warning("The following fields were present in the request but ignored: %s",
                           ", ".join(request.ignored_fields))
            self.engine.prometheus.record_ignored_fields(request.ignored_fields)
        try:
            params = [self._params(ids, request, adjust) for _, ids in prompts]
        except ValueError as e:
            raise bad_request(e) from None
        rid = f"{prefix}-{request_id_of(raw_request)}"
        if rid in self.engine.streams:
            raise APIError(400, f"X-Request-Id {raw_request.headers.get('x-request-id')!r} is already in use by a "
                                f"request in flight", "BadRequestError", "X-Request-Id")
        # one engine request per prompt
        sub_ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
        if tracer.enabled:  # steps 11 (body parsed and validated) and 12 (tokenised)
            arrival = getattr(raw_request.state, "arrival", t_entry)
            tracer.record(Step.API_PARSE, arrival, t_entry, sub_ids, endpoint=raw_request.url.path, stream=request.stream)
            tracer.record(Step.TOKENIZER_ENCODE, t_entry, time.monotonic(), sub_ids, prompt_tokens=sum(len(p) for _, p in prompts))
        try:  # every prompt's engine, before any is sent
            engines = self.engine.route(sub_ids, params[0].n, request.data_parallel_rank)
        except EngineOverloadedError as e:
            raise APIError(503, str(e), "ServiceUnavailableError",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except ParamError as e:  # more sequences than a queue may hold
            raise bad_request(e) from None
        except ValueError as e:  # a bad pinned rank
            raise APIError(400, str(e), "BadRequestError", "data_parallel_rank") from None
        except RuntimeError as e:  # no engine running (EngineDeadError)
            raise APIError(503, str(e), "ServiceUnavailableError") from None
        handles = []
        try:
            for sub_id, (text, ids), sp, engine in zip(sub_ids, prompts, params, engines):
                handles.append(self.engine.add_request(sub_id, text, ids, sp, request.stream,
                                                       engine_index=engine))
        # a bad pinned rank; an engine not running, or whose input queue is full: the prompts
        # already sent are aborted, so no part of a failed request runs
        except (ValueError, EngineDeadError, EngineBusyError) as e:
            for h in handles:
                self.engine.abort(h.request_id)
            if isinstance(e, ValueError):
                raise APIError(400, str(e), "BadRequestError", "data_parallel_rank") from None
            raise APIError(503, str(e), "ServiceUnavailableError") from None
        return rid, handles, params[0].n

    @staticmethod
    def _headers(handles: list[RequestStream]) -> dict[str, str]:
        # which data-parallel replica served it (the balancer's choice, step 13)
        return {"X-Data-Parallel-Rank": ",".join(str(h.engine_index) for h in handles)}

    async def _finals(self, raw_request: Request, handles: list[RequestStream]) -> list[RequestOutput] | None:
        """Every request's final output; None if the client disconnected first."""
        async def collect() -> list[RequestOutput]:
            finals: list[RequestOutput | None] = [None] * len(handles)
            async for i, out in merge([self.engine.outputs(h) for h in handles]):
                finals[i] = out
            return finals  # type: ignore[return-value]

        try:
            return await until_disconnected(raw_request, collect())
        except Exception as e:
            raise engine_error(e) from None

    @staticmethod
    def _timing(finals: list[RequestOutput]) -> dict | list[dict]:
        """return_timing: one request's timing, or one per prompt of a batched completion."""
        return finals[0].metrics if len(finals) == 1 else [r.metrics for r in finals]

    def _respond(self, resp: CompletionResponse | ChatCompletionResponse, request: SamplingRequest,
                 finals: list[RequestOutput], handles: list[RequestStream]) -> JSONResponse:
        """The non-streaming answer (step 39: the response written)."""
        t0 = time.monotonic()
        body = resp.model_dump()
        if request.return_timing:
            body["timing"] = self._timing(finals)
        response = JSONResponse(body, headers=self._headers(handles))
        for h in handles:
            trace_chunk(h.request_id, t0, 0, len(resp.choices))
        return response

    @staticmethod
    def _final_chunks(base: dict, request: SamplingRequest, prompt_tokens: int, completion_tokens: int,
                      finals: list[RequestOutput]) -> list[str]:
        """What a stream sends after its last token: usage, when asked; timing, when asked."""
        chunks = []
        if request.stream_options and request.stream_options.include_usage:
            chunks.append(sse({**base, "choices": [], "usage": UsageInfo(
                prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens).model_dump(exclude_none=True)}))
        if request.return_timing:
            chunks.append(sse({**base, "choices": [], "timing": OpenAIServing._timing(finals)}))
        return chunks

    @staticmethod
    def _continuous_usage(request: SamplingRequest, prompt_tokens: int, completion_tokens: int) -> dict:
        """stream_options.continuous_usage_stats (with include_usage, as vLLM): each chunk's usage so far."""
        so = request.stream_options
        if so is None or not (so.include_usage and so.continuous_usage_stats):
            return {}
        return {"usage": UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                   total_tokens=prompt_tokens + completion_tokens).model_dump(exclude_none=True)}

    @staticmethod
    def _usage(finals: list[RequestOutput]) -> UsageInfo:
        prompt = sum(len(r.prompt_token_ids) for r in finals)
        completion = sum(len(c.token_ids) for r in finals for c in r.outputs)
        cached = sum(r.num_cached_tokens for r in finals)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                         prompt_tokens_details={"cached_tokens": cached})

    # -- logprobs ----------------------------------------------------------------
    # the output processor's token strings: each as it reads inside the text (" Paris"), or
    # "token_id:<id>" with return_tokens_as_token_ids
    @staticmethod
    def _token_name(tid: int, v, as_ids: bool) -> str:
        return f"token_id:{tid}" if as_ids else v.decoded_token

    def _completion_logprobs(self, c: CompletionOutput, num: int, offset: int,
                             as_ids: bool = False) -> CompletionLogprobs:
        lp = CompletionLogprobs()
        for tid, entry in zip(c.token_ids, c.logprobs or []):
            tok = self._token_name(tid, entry[tid], as_ids)
            lp.tokens.append(tok)
            lp.token_logprobs.append(entry[tid].logprob)
            lp.top_logprobs.append({self._token_name(t, v, as_ids): v.logprob for t, v in entry.items()
                                    if t == tid or (v.rank is not None and v.rank <= num)})
            lp.text_offset.append(offset)
            offset += len(entry[tid].decoded_token)
        return lp

    def _chat_logprobs(self, c: CompletionOutput, num: int, as_ids: bool = False) -> ChatLogprobs:
        content = []
        for tid, entry in zip(c.token_ids, c.logprobs or []):
            tok = self._token_name(tid, entry[tid], as_ids)
            tops = sorted(((t, v) for t, v in entry.items() if v.rank is not None and v.rank <= num),
                          key=lambda tv: tv[1].rank)
            content.append(ChatLogprobToken(
                token=tok, logprob=entry[tid].logprob, bytes=list(entry[tid].decoded_token.encode()),
                top_logprobs=[TopLogprob(token=self._token_name(t, v, as_ids), logprob=v.logprob,
                                         bytes=list(v.decoded_token.encode())) for t, v in tops]))
        return ChatLogprobs(content=content)

    # -- /v1/completions -----------------------------------------------------------
    def _completion_prompts(self, request: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        p = request.prompt
        if isinstance(p, str):
            p = [p]
        if not p:
            raise APIError(400, "the prompt is empty", "BadRequestError", "prompt")
        if isinstance(p[0], int):
            return [(None, list(p))]
        out = []
        for item in p:
            if isinstance(item, str):
                out.append((item, self.tokenizer.encode(item, add_special_tokens=request.add_special_tokens)))
            else:
                out.append((None, list(item)))
        return out

    async def create_completion(self, request: CompletionRequest, raw_request: Request):
        t_entry = time.monotonic()
        self.check_model(request.model)
        prompts = self._completion_prompts(request)
        rid, handles, n = self._start("cmpl", prompts, request, raw_request, t_entry)
        model = request.model or self.served_model_names[0]
        echo = [(t if t is not None else self.tokenizer.decode(ids)) if request.echo else ""
                for t, ids in prompts]
        num_lp = request.logprobs or 0
        if request.stream:
            num_prompt_tokens = sum(len(ids) for _, ids in prompts)
            return StreamingResponse(self._stream_completion(rid, model, handles, n, echo, request, num_lp,
                                                             num_prompt_tokens),
                                     media_type="text/event-stream", headers=self._headers(handles))
        finals = await self._finals(raw_request, handles)
        if finals is None:  # the client went away; its requests were aborted
            return None
        choices = []
        for i, r in enumerate(finals):
            for c in r.outputs:
                choices.append(CompletionChoice(
                    index=i * n + c.index, text=echo[i] + c.text, finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    logprobs=self._completion_logprobs(c, num_lp, len(echo[i]), request.return_tokens_as_token_ids)
                    if request.logprobs is not None else None))
        resp = CompletionResponse(id=rid, model=model, choices=choices, usage=self._usage(finals),
                                  kv_transfer_params=finals[0].kv_transfer_params if len(finals) == 1 else None)
        return self._respond(resp, request, finals, handles)

    async def _stream_completion(self, rid: str, model: str, handles: list[RequestStream], n: int,
                                 echo: list[str], request: CompletionRequest, num_lp: int,
                                 num_prompt_tokens: int) -> AsyncIterator[str]:
        offsets = {}
        finals: list[RequestOutput | None] = [None] * len(handles)
        tokens = [[0] * n for _ in handles]
        base = CompletionResponse(id=rid, model=model, choices=[]).model_dump(exclude={"usage"})
        encode = ChunkEncoder(base)
        sent = [0] * len(handles)  # chunks sent per prompt: its first is step 39, later ones 50
        try:
            async for i, out in merge([self.engine.outputs(h) for h in handles]):
                finals[i] = out
                choices = []
                for c in out.outputs:
                    idx = i * n + c.index
                    tokens[i][c.index] += len(c.token_ids)
                    first = idx not in offsets
                    text = (echo[i] if first else "") + c.text
                    # tokens whose text is held back (half a UTF-8 character, a possible stop
                    # string) wait for the next chunk, unless their logprobs must go now
                    if not text and c.finish_reason is None and (request.logprobs is None or not c.token_ids):
                        continue
                    offset = offsets.get(idx, 0)
                    lp = (self._completion_logprobs(c, num_lp, offset + len(text) - len(c.text),
                                                    request.return_tokens_as_token_ids).model_dump()
                          if request.logprobs is not None else None)
                    offsets[idx] = offset + len(text)
                    choices.append({"index": idx, "text": text, "logprobs": lp,
                                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
                if choices:
                    t0 = time.monotonic()
                    chunk = encode(choices, self._continuous_usage(request, num_prompt_tokens, sum(map(sum, tokens))))
                    trace_chunk(handles[i].request_id, t0, sent[i], len(choices))
                    sent[i] += 1
                    yield chunk
            for chunk in self._final_chunks(base, request, sum(len(r.prompt_token_ids) for r in finals),
                                            sum(map(sum, tokens)), finals):
                yield chunk
        except Exception as e:  # an engine died mid-stream: say so in the stream
            yield sse(error_body(500, str(e), "InternalServerError"))
        yield "data: [DONE]\n\n"

    # -- /v1/chat/completions ------------------------------------------------------
    def _output_parsers(self, request: ChatCompletionRequest, n: int) -> list[ChatOutputParser] | None:
        """One parser per choice, when the output has reasoning or tool calls to split out;
        None when it is all content (the plain path)."""
        opts = self.chat
        reasoning = None
        if opts.reasoning_parser is not None:
            cls = REASONING_PARSERS[opts.reasoning_parser]
            reasoning = cls if cls.thinks(request.chat_template_kwargs) else None
        tools: Callable | None = None
        choice = request.tool_choice
        if request.tools and choice != "none":
            named, _ = request.forced_tool_schema()
            if named is not None:
                tools = lambda: NamedToolParser(named)  # noqa: E731
            elif choice == "required":
                tools = RequiredToolParser
            else:  # auto
                if not (opts.enable_auto_tool_choice and opts.tool_call_parser):
                    raise ParamError("tool_choice", '"auto" tool choice requires --enable-auto-tool-choice and '
                                                    "--tool-call-parser to be set")
                tools = TOOL_PARSERS[opts.tool_call_parser]
        if reasoning is None and tools is None:
            return None
        return [ChatOutputParser(reasoning() if reasoning else None, tools() if tools else None) for _ in range(n)]

    def _chat_params(self, request: ChatCompletionRequest,
                     parsers: list[ChatOutputParser] | None) -> Callable[[list[int], SamplingParams], SamplingParams]:
        """What the chat route sets on a request's SamplingParams: special tokens kept for a
        tool format written in them; structured outputs held until the reasoning ends."""
        def adjust(prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
            if parsers is None:
                return params
            p = parsers[0]
            if p.tools is not None and p.tools.keeps_special_tokens:
                params.skip_special_tokens = False
            so = params.structured_outputs
            if p.reasoning is not None and so is not None:
                end = self.tokenizer.encode(p.reasoning.end, add_special_tokens=False)
                # a template that closes the thinking itself ends the prompt with the marker
                # (V3.1's non-thinking mode); else the constraint waits for the model's (an
                # earlier turn's </think> in the history does not count)
                if not _in_tail(prompt_ids, end, 2):
                    params.structured_outputs = dataclasses.replace(so, reasoning_end=end)
            return params
        return adjust

    async def create_chat_completion(self, request: ChatCompletionRequest, raw_request: Request):
        t_entry = time.monotonic()
        self.check_model(request.model)
        try:
            conversation = request.conversation()
            parsers = self._output_parsers(request, request.n)
        except ParamError as e:
            raise bad_request(e) from None
        try:
            ids = self.engine.processor.apply_chat_template(
                conversation, request.add_generation_prompt, request.chat_template or self.chat.chat_template,
                tools=request.tool_dicts(), chat_template_kwargs=request.chat_template_kwargs)
        except ParamError as e:
            raise bad_request(e) from None
        except Exception as e:  # a template that fails on these messages
            raise APIError(400, f"the chat template failed: {e}", "BadRequestError", "messages") from None
        rid, handles, n = self._start("chatcmpl", [(None, ids)], request, raw_request, t_entry,
                                      self._chat_params(request, parsers))
        model = request.model or self.served_model_names[0]
        num_lp = request.top_logprobs or 0
        if request.stream:
            return StreamingResponse(self._stream_chat(rid, model, handles[0], n, request, num_lp, parsers, ids),
                                     media_type="text/event-stream", headers=self._headers(handles))
        finals = await self._finals(raw_request, handles)
        if finals is None:  # the client went away; its requests were aborted
            return None
        choices = []
        for c in finals[0].outputs:
            message, finish = ChatResponseMessage(content=c.text), c.finish_reason
            if parsers is not None:
                parsed = parsers[c.index].parse(c.text)
                message = ChatResponseMessage(
                    content=parsed.content, reasoning_content=parsed.reasoning_content,
                    tool_calls=[ToolCallItem(id=tc.id, function=FunctionCall(name=tc.name, arguments=tc.arguments))
                                for tc in parsed.tool_calls])
                if parsed.tool_calls and finish == "stop" and parsers[c.index].finishes_with_tool_calls:
                    finish = "tool_calls"
            choices.append(ChatChoice(index=c.index, message=message, finish_reason=finish,
                                      stop_reason=c.stop_reason,
                                      logprobs=self._chat_logprobs(c, num_lp, request.return_tokens_as_token_ids)
                                      if request.logprobs else None))
        resp = ChatCompletionResponse(id=rid, model=model, choices=choices, usage=self._usage(finals),
                                      kv_transfer_params=finals[0].kv_transfer_params)
        return self._respond(resp, request, finals, handles)

    async def _stream_chat(self, rid: str, model: str, handle: RequestStream, n: int,
                           request: ChatCompletionRequest, num_lp: int,
                           parsers: list[ChatOutputParser] | None, prompt_ids: list[int]) -> AsyncIterator[str]:
        base = ChatCompletionChunk(id=rid, model=model, choices=[]).model_dump(exclude={"usage"})
        encode = ChunkEncoder(base)
        finished: set[int] = set()
        completion_tokens = 0
        sent = 0
        final: RequestOutput | None = None
        try:
            yield sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None} for i in range(n)],
                       **self._continuous_usage(request, len(prompt_ids), 0)})
            async for out in self.engine.outputs(handle):
                final = out
                choices = []
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    if c.index in finished:
                        continue
                    finish = c.finish_reason
                    if parsers is None:
                        delta = {"content": c.text} if c.text or finish is not None or request.logprobs else {}
                    else:
                        p = parsers[c.index]
                        d = p.delta(c.text, finish is not None)
                        delta = _delta_dict(d) if d is not None else {}
                        if finish == "stop" and p.called_tools and p.finishes_with_tool_calls:
                            finish = "tool_calls"
                    if not delta and finish is None and (not request.logprobs or not c.token_ids):
                        continue
                    if finish is not None:
                        finished.add(c.index)
                    choices.append({
                        "index": c.index, "delta": delta,
                        "logprobs": self._chat_logprobs(c, num_lp, request.return_tokens_as_token_ids).model_dump()
                        if request.logprobs else None,
                        "finish_reason": finish, "stop_reason": c.stop_reason})
                if choices:
                    t0 = time.monotonic()
                    chunk = encode(choices, self._continuous_usage(request, len(prompt_ids), completion_tokens))
                    trace_chunk(handle.request_id, t0, sent, len(choices))
                    sent += 1
                    yield chunk
            for chunk in self._final_chunks(base, request, len(final.prompt_token_ids), completion_tokens,
                                            [final]):
                yield chunk
        except Exception as e:
            yield sse(error_body(500, str(e), "InternalServerError"))
        yield "data: [DONE]\n\n"

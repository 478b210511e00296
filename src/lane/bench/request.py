"""One streamed request against an OpenAI-compatible server, timed the way
vllm bench serve and AISBench time it: TTFT at the first chunk that carries text,
one ITL per later chunk, E2EL at the end of the stream."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx2 as httpx


@dataclass
class RequestInput:
    prompt: str
    prompt_len: int
    max_tokens: int
    model: str
    endpoint: str  # "completions" or "chat"
    ignore_eos: bool = False
    extra_body: dict = field(default_factory=dict)


@dataclass
class RequestOutput:
    success: bool = False
    start_time: float = 0.0  # seconds since the run started
    ttft: float = 0.0
    latency: float = 0.0  # E2EL
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    output_tokens: int = 0
    output_tokens_from_usage: bool = False
    chunk_times: list[float] = field(default_factory=list)  # seconds since the run started
    generated_text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens > 1:
            return (self.latency - self.ttft) / (self.output_tokens - 1)
        return None


def endpoint_path(endpoint: str) -> str:
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


def build_body(req: RequestInput) -> dict:
    body = {"model": req.model, "max_tokens": req.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **req.extra_body}
    if req.ignore_eos:
        body["ignore_eos"] = True
    if req.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


def chunk_text(chunk: dict, endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def send_request(client: httpx.AsyncClient, url: str, req: RequestInput, t_zero: float) -> RequestOutput:
    out = RequestOutput(prompt_len=req.prompt_len)
    st = time.perf_counter()
    out.start_time = st - t_zero
    last = st
    text_parts: list[str] = []
    try:
        async with client.stream("POST", url, json=build_body(req)) as r:
            if r.status_code != 200:
                body = (await r.aread()).decode(errors="replace")
                out.error = f"HTTP {r.status_code}: {body[:300]}"
                return out
            async for line in r.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = f"error in stream: {chunk['error']}"
                    return out
                now = time.perf_counter()
                text = chunk_text(chunk, req.endpoint)
                if text:
                    if not text_parts:
                        out.ttft = now - st
                    else:
                        out.itl.append(now - last)
                    last = now
                    text_parts.append(text)
                    out.chunk_times.append(now - t_zero)
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    out.output_tokens = usage["completion_tokens"]
                    out.output_tokens_from_usage = True
                    if usage.get("prompt_tokens"):
                        out.prompt_len = usage["prompt_tokens"]
        out.latency = time.perf_counter() - st
        out.generated_text = "".join(text_parts)
        if not out.output_tokens_from_usage:  # a server without usage: one token per chunk
            out.output_tokens = len(out.chunk_times)
        out.success = bool(text_parts) or out.output_tokens > 0
        if not out.success:
            out.error = "the stream ended without any output"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out

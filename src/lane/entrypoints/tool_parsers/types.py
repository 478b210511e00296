"""What the parsers return (OpenAI's tool call and streaming delta shapes, as dataclasses)
and ``ToolParser``, the streaming machinery every format shares: a format only says where
its calls start (``start``) and how far a call is written so far (``scan``)."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Callable


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=tool_call_id)


@dataclass
class DeltaToolCall:
    index: int
    id: str | None = None  # with the name, in the call's first delta
    name: str | None = None
    arguments: str = ""  # a fragment; a call's fragments join to its arguments


@dataclass
class DeltaMessage:
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


@dataclass
class PartialCall:
    """A call as far as it is written: its name once complete, and arguments text that only
    grows (what a streamed call's fragments join to so far)."""
    name: str | None
    arguments: str
    closed: bool


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``marker`` (kept back
    while streaming, so a marker split over deltas never leaks as text)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


_NAME = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')


def scan_between(text: str, begin: str, end: str,
                 parse: Callable[[str, bool], PartialCall | None]) -> list[PartialCall]:
    """The calls in ``text``, each between ``begin`` and ``end``, parsed by ``parse(body,
    closed)``; the last may be open (its body so far, less what could begin ``end``). A closed
    body that does not parse ends the scan with a failed call: the output is not a tool call."""
    calls, pos = [], 0
    while (pos := text.find(begin, pos)) >= 0:
        body_start = pos + len(begin)
        close = text.find(end, body_start)
        closed = close >= 0
        body = text[body_start:close] if closed else text[body_start:len(text) - held_back(text, end)]
        call = parse(body, closed)
        if call is None:
            return calls + [PartialCall(None, "", True)]
        calls.append(call)
        if not closed:
            break
        pos = close + len(end)
    return calls


def named_object(body: str, closed: bool, args_key: str) -> PartialCall | None:
    """A call written as a JSON object ``{"name": ..., "<args_key>": {...}}`` (Hermes, and
    tool_choice=required's array items). While the object is open, the arguments grow up to
    their last safe character (trailing braces may be the object's own); once closed, the
    object must parse (None if not)."""
    m = _NAME.search(body)
    a = re.search(rf'"{args_key}"\s*:\s*', body)
    if closed:
        try:
            obj = json.loads(body)
            name, args = obj["name"], obj.get(args_key, {})
        except (ValueError, KeyError, TypeError):
            return None
        if not isinstance(name, str):
            return None
        if m and a and m.end() <= a.start():  # raw text, so the streamed fragments are a prefix of it
            raw = body[a.end():].strip()
            return PartialCall(name, raw[:-1].rstrip() if raw.endswith("}") else raw, True)
        return PartialCall(name, args if isinstance(args, str) else json.dumps(args, ensure_ascii=False), True)
    if m is None:
        return PartialCall(None, "", False)
    raw = body[a.end():] if a is not None and m.end() <= a.start() else ""
    return PartialCall(json.loads(m.group(1)), raw.rstrip().rstrip("}").rstrip(), False)


class ToolParser:
    """A model's tool-call format. Text before ``start`` is content; ``scan(text)`` reads the
    calls from ``start`` on. Non-streaming: ``extract``; streaming: ``extract_streaming`` per
    text delta (content until a call starts, a possible partial ``start`` held back; a call's
    id and name once its name is complete, then argument fragments as they grow), and
    ``finish`` at the end (what was held back)."""
    start: str = ""
    keeps_special_tokens = False  # the format's markers are special tokens: decode keeps them

    def __init__(self) -> None:
        self.text = ""
        self.content_sent = 0
        self.ids: list[str] = []
        self.args_sent: list[int] = []  # -1: the call's name not sent yet

    def scan(self, text: str) -> list[PartialCall]:
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls); an output without well-formed calls is all content."""
        i = text.find(self.start)
        if i < 0:
            return text, []
        calls = self.scan(text[i:])
        if not calls or not all(c.closed and c.name for c in calls):
            return text, []
        return text[:i].strip() or None, [ToolCall(c.name, c.arguments) for c in calls]

    def extract_streaming(self, delta: str) -> DeltaMessage | None:
        self.text += delta
        out = DeltaMessage()
        i = self.text.find(self.start) if self.start else 0
        end = i if i >= 0 else len(self.text) - held_back(self.text, self.start)
        if end > self.content_sent:
            out.content = self.text[self.content_sent:end]
            self.content_sent = end
        if i >= 0:
            for k, call in enumerate(self.scan(self.text[i:])):
                if k == len(self.ids):
                    self.ids.append(tool_call_id())
                    self.args_sent.append(-1)
                if call.name is None:
                    break
                d = None
                if self.args_sent[k] < 0:
                    d = DeltaToolCall(k, self.ids[k], call.name)
                    out.tool_calls.append(d)
                    self.args_sent[k] = 0
                if len(call.arguments) > self.args_sent[k]:
                    if d is None:
                        d = DeltaToolCall(k)
                        out.tool_calls.append(d)
                    d.arguments = call.arguments[self.args_sent[k]:]
                    self.args_sent[k] = len(call.arguments)
        return out if out.content or out.tool_calls else None

    @property
    def called(self) -> bool:
        """Whether a call went out (its name sent): the stream is then a tool-call answer."""
        return any(n >= 0 for n in self.args_sent)

    def finish(self) -> DeltaMessage | None:
        """The end of the output: what was held back goes out as content, a possible marker, or
        a call that never parsed (no name sent): then it is text, as ``extract`` says."""
        if self.called or self.content_sent >= len(self.text):
            return None
        rest, self.content_sent = self.text[self.content_sent:], len(self.text)
        return DeltaMessage(content=rest)

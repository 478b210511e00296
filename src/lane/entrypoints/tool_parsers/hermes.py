"""``hermes``: the Hermes / Qwen tool-call format, one JSON object per call between
``<tool_call>`` and ``</tool_call>`` (``{"name": ..., "arguments": {...}}``), text before the
first call being content."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from lane.entrypoints.tool_parsers.types import DeltaMessage, DeltaToolCall, ToolCall, held_back, tool_call_id

START, END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')
_ARGS = re.compile(r'"arguments"\s*:\s*')


def _arguments(obj: dict) -> str:
    args = obj.get("arguments", obj.get("parameters", {}))
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


@dataclass
class _Call:
    id: str = field(default_factory=tool_call_id)
    name_sent: bool = False
    args_sent: int = 0  # characters of the raw arguments value sent
    done: bool = False


class HermesToolParser:
    def __init__(self) -> None:
        self.text = ""
        self.content_sent = 0
        self.calls: list[_Call] = []

    # -- a whole output ---------------------------------------------------------------
    @staticmethod
    def extract(text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls); an output without a well-formed call is all content."""
        calls = []
        for body in re.findall(re.escape(START) + r"(.*?)" + re.escape(END), text, re.S):
            try:
                obj = json.loads(body)
                calls.append(ToolCall(obj["name"], _arguments(obj)))
            except (ValueError, KeyError, TypeError):
                return text, []
        if not calls:
            return text, []
        content = text[:text.index(START)].strip()
        return content or None, calls

    # -- streaming -----------------------------------------------------------------------
    def extract_streaming(self, delta: str) -> DeltaMessage | None:
        """Feed the next text delta; returns what to send for it (None: nothing yet). Content
        streams until a call starts (a partial ``<tool_call>`` is held back); a call sends its
        id and name once the name is complete, then argument fragments as they grow."""
        self.text += delta
        out = DeltaMessage()
        first = self.text.find(START)
        end = first if first >= 0 else len(self.text) - held_back(self.text, START)
        if end > self.content_sent:
            out.content = self.text[self.content_sent:end]
            self.content_sent = end
        pos, index = first, 0
        while pos >= 0:
            body_start = pos + len(START)
            close = self.text.find(END, body_start)
            body = self.text[body_start:close if close >= 0 else len(self.text)]
            if index == len(self.calls):
                self.calls.append(_Call())
            call = self.calls[index]
            if not call.done:
                self._advance(call, index, body, close >= 0, out)
            if close < 0:
                break
            pos, index = self.text.find(START, close + len(END)), index + 1
        return out if out.content or out.tool_calls else None

    def _advance(self, call: _Call, index: int, body: str, closed: bool, out: DeltaMessage) -> None:
        if not call.name_sent and (m := _NAME.search(body)):
            out.tool_calls.append(DeltaToolCall(index, call.id, json.loads(m.group(1))))
            call.name_sent = True
        a = _ARGS.search(body)
        if closed:  # the whole object: send what is left of its arguments
            try:
                obj = json.loads(body)
            except ValueError:
                call.done = True
                return
            if not call.name_sent:
                out.tool_calls.append(DeltaToolCall(index, call.id, obj.get("name")))
                call.name_sent = True
            full = _arguments(obj)
            if call.args_sent and a is not None:  # raw fragments went out: finish the raw value
                raw = body[a.end():].rstrip()
                full = raw[:-1].rstrip() if raw.endswith("}") else raw
            rest = full[call.args_sent:]
            self._send_args(out, index, rest)
            call.args_sent, call.done = len(full), True
            return
        if call.name_sent and a is not None:
            raw = body[a.end():len(body) - held_back(body, END)]  # not a partial </tool_call>
            safe = len(raw.rstrip().rstrip("}"))  # the object's own closing brace may follow
            if safe > call.args_sent:
                self._send_args(out, index, raw[call.args_sent:safe])
                call.args_sent = safe

    @staticmethod
    def _send_args(out: DeltaMessage, index: int, text: str) -> None:
        if not text:
            return
        for d in out.tool_calls:
            if d.index == index:
                d.arguments += text
                return
        out.tool_calls.append(DeltaToolCall(index, arguments=text))

"""``hermes``: the Hermes / Qwen tool-call format, one JSON object per call between
``<tool_call>`` and ``</tool_call>`` (``{"name": ..., "arguments": {...}}``), text before the
first call being content."""
from __future__ import annotations

from lane.entrypoints.tool_parsers.types import PartialCall, ToolParser, held_back, named_object

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    start = START

    def scan(self, text: str) -> list[PartialCall]:
        calls, pos = [], 0
        while (pos := text.find(START, pos)) >= 0:
            body_start = pos + len(START)
            close = text.find(END, body_start)
            closed = close >= 0
            body = text[body_start:close] if closed else text[body_start:len(text) - held_back(text, END)]
            call = named_object(body, closed, "arguments")
            if call is None:  # a closed call that does not parse: the output is not a tool call
                return calls + [PartialCall(None, "", True)]
            calls.append(call)
            if not closed:
                break
            pos = close + len(END)
        return calls

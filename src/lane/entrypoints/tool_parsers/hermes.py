"""``hermes``: the Hermes / Qwen tool-call format, one JSON object per call between
``<tool_call>`` and ``</tool_call>`` (``{"name": ..., "arguments": {...}}``), text before the
first call being content."""
from __future__ import annotations

from lane.entrypoints.tool_parsers.types import PartialCall, ToolParser, named_object, scan_between

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    start = START

    def scan(self, text: str) -> list[PartialCall]:
        return scan_between(text, START, END, lambda body, closed: named_object(body, closed, "arguments"))

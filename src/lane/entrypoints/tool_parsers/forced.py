"""Outputs of a forced tool choice, which structured outputs shaped (so they always parse):
a named function's output is its arguments object; ``required``'s is a JSON array of
``{"name": ..., "parameters": {...}}``, one per call."""
from __future__ import annotations

import json

from lane.entrypoints.tool_parsers.types import PartialCall, ToolParser, named_object


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """The JSON schema of tool_choice=required: one call or more (one with parallel_tool_calls
    false) of the given functions, each with its own parameters' schema."""
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [f["name"]]},
                             "parameters": f.get("parameters") or {"type": "object"}},
              "required": ["name", "parameters"]} for f in tools]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class NamedToolParser(ToolParser):
    """tool_choice names a function: the whole output is its arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def scan(self, text: str) -> list[PartialCall]:
        return [PartialCall(self.name, text.strip(), True)]

    def extract(self, text: str):
        return super().extract(text) if text.strip() else (None, [])


class RequiredToolParser(ToolParser):
    """tool_choice=required: a JSON array of calls; a call's name streams once complete, its
    parameters as they grow."""

    def scan(self, text: str) -> list[PartialCall]:
        calls, depth, in_string, escaped, start = [], 0, False, False, -1
        for i, ch in enumerate(text):
            if in_string:
                escaped, in_string = (False, True) if escaped else (ch == "\\", ch != '"')
                continue
            if ch == '"':
                in_string = True
            elif ch in "[{":
                depth += 1
                if depth == 2 and ch == "{":
                    start = i
            elif ch in "]}":
                if depth == 2 and ch == "}":
                    call = named_object(text[start:i + 1], True, "parameters")
                    calls.append(call or PartialCall(None, "", True))
                    start = -1
                depth -= 1
        if start >= 0:
            calls.append(named_object(text[start:], False, "parameters"))
        return calls

    def extract(self, text: str):
        try:
            items = json.loads(text)
        except ValueError:
            return text, []
        return super().extract(text) if isinstance(items, list) and items else (text, [])

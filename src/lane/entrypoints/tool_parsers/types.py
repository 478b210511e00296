"""What the parsers return: OpenAI's tool call and streaming delta shapes, as dataclasses."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field


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


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``marker`` (kept back
    while streaming, so a marker split over deltas never leaks as text)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0

"""One chat completion choice's output, split: reasoning first (when a reasoning parser is
on), then content and tool calls from the text after it (when a tool parser is on)."""
from __future__ import annotations

from dataclasses import dataclass, field

from lane.entrypoints.tool_parsers.forced import NamedToolParser
from lane.entrypoints.tool_parsers.reasoning import DeepSeekR1ReasoningParser
from lane.entrypoints.tool_parsers.types import DeltaMessage, ToolCall, ToolParser


@dataclass
class ParsedOutput:
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


class ChatOutputParser:
    def __init__(self, reasoning: DeepSeekR1ReasoningParser | None, tools: ToolParser | None) -> None:
        self.reasoning, self.tools = reasoning, tools

    def parse(self, text: str) -> ParsedOutput:
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.extract(text)
            text = text or ""
        if self.tools is None:
            return ParsedOutput(text or None, reasoning)
        content, calls = self.tools.extract(text)
        return ParsedOutput(content if calls else (text or None), reasoning, calls)

    def delta(self, text: str, final: bool) -> DeltaMessage | None:
        """What a streamed chunk carries for this text delta (final: the output ends with it)."""
        out = DeltaMessage()
        content = text
        if self.reasoning is not None:
            d = self.reasoning.extract_streaming(text) if text else None
            if final:
                d = _join(d, self.reasoning.finish())
            content = (d.content or "") if d else ""
            out.reasoning_content = d.reasoning_content if d else None
        if self.tools is not None:
            d = self.tools.extract_streaming(content) if content else None
            if final:
                d = _join(d, self.tools.finish())
            out.content = d.content if d else None
            out.tool_calls = d.tool_calls if d else []
        else:
            out.content = content or None
        return out if out.content or out.reasoning_content or out.tool_calls else None

    @property
    def called_tools(self) -> bool:
        return self.tools is not None and self.tools.called

    @property
    def finishes_with_tool_calls(self) -> bool:
        """finish_reason tool_calls once calls are made; a named tool_choice keeps stop (OpenAI, vLLM)."""
        return not isinstance(self.tools, NamedToolParser)


def _join(a: DeltaMessage | None, b: DeltaMessage | None) -> DeltaMessage | None:
    if a is None or b is None:
        return a or b
    a.content = (a.content or "") + (b.content or "") or None
    a.reasoning_content = (a.reasoning_content or "") + (b.reasoning_content or "") or None
    a.tool_calls += b.tool_calls
    return a

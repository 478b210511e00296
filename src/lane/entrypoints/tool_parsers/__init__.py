"""Tool-call and reasoning parsers (vLLM's ``--tool-call-parser`` / ``--reasoning-parser``):
from a model's raw output text, what is content, what is reasoning and which tool calls it
made, whole or as streaming deltas. Pure text: no model, no server.

Not wired into the server yet (issue 17's second half): ``hermes`` and ``deepseek_r1`` exist
and are tested on fixed outputs."""
from lane.entrypoints.tool_parsers.hermes import HermesToolParser
from lane.entrypoints.tool_parsers.reasoning import DeepSeekR1ReasoningParser
from lane.entrypoints.tool_parsers.types import DeltaMessage, DeltaToolCall, ToolCall

TOOL_PARSERS = {"hermes": HermesToolParser}
REASONING_PARSERS = {"deepseek_r1": DeepSeekR1ReasoningParser}

__all__ = ["DeltaMessage", "DeltaToolCall", "DeepSeekR1ReasoningParser", "HermesToolParser", "REASONING_PARSERS",
           "TOOL_PARSERS", "ToolCall"]

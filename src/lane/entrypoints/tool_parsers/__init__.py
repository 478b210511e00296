"""Tool-call and reasoning parsers (vLLM's ``--tool-call-parser`` / ``--reasoning-parser``):
from a model's raw output text, what is content, what is reasoning and which tool calls it
made, whole or as streaming deltas. Pure text: no model, no server (``chat_output`` chains
them for one choice of a chat completion)."""
from lane.entrypoints.tool_parsers.deepseek import (DeepSeekV3ToolParser, DeepSeekV4ToolParser,
                                                    DeepSeekV31ToolParser, DeepSeekV32ToolParser)
from lane.entrypoints.tool_parsers.forced import NamedToolParser, RequiredToolParser, required_schema
from lane.entrypoints.tool_parsers.hermes import HermesToolParser
from lane.entrypoints.tool_parsers.reasoning import DeepSeekR1ReasoningParser, DeepSeekV3ReasoningParser
from lane.entrypoints.tool_parsers.types import DeltaMessage, DeltaToolCall, ToolCall, ToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "deepseek_v3": DeepSeekV3ToolParser, "deepseek_v31": DeepSeekV31ToolParser,
    "deepseek_v32": DeepSeekV32ToolParser, "deepseek_v4": DeepSeekV4ToolParser}
REASONING_PARSERS = {"deepseek_r1": DeepSeekR1ReasoningParser, "deepseek_v3": DeepSeekV3ReasoningParser,
                     "deepseek_v4": DeepSeekV3ReasoningParser}

__all__ = ["DeltaMessage", "DeltaToolCall", "DeepSeekR1ReasoningParser", "DeepSeekV3ReasoningParser",
           "DeepSeekV3ToolParser", "DeepSeekV31ToolParser", "DeepSeekV32ToolParser", "DeepSeekV4ToolParser",
           "HermesToolParser", "NamedToolParser", "REASONING_PARSERS", "RequiredToolParser", "TOOL_PARSERS",
           "ToolCall", "ToolParser", "required_schema"]

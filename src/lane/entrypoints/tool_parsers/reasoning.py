"""Reasoning parsers (vLLM's ``--reasoning-parser``): thinking between ``<think>`` and
``</think>`` goes to ``reasoning_content`` (vLLM's field), the rest to content.

- ``deepseek_r1``: always thinks. R1-style chat templates open ``<think>`` in the prompt, so
  an output may start inside the reasoning without the opening tag.
- ``deepseek_v3`` (V3.1, V3.2, V4): thinks only when the request turns it on in
  ``chat_template_kwargs`` (``thinking`` or ``enable_thinking``), as those templates do;
  otherwise the output is all content."""
from __future__ import annotations

from lane.entrypoints.tool_parsers.types import DeltaMessage, held_back

THINK, END_THINK = "<think>", "</think>"


class DeepSeekR1ReasoningParser:
    start, end = THINK, END_THINK

    @staticmethod
    def thinks(chat_template_kwargs: dict | None) -> bool:
        return True

    def __init__(self) -> None:
        self.text = ""
        self.sent = 0  # characters of text consumed into deltas

    @staticmethod
    def extract(text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content). No ``</think>``: all of it is reasoning (cut short)."""
        body = text[len(THINK):] if text.startswith(THINK) else text
        if END_THINK not in body:
            return body or None, None
        reasoning, _, content = body.partition(END_THINK)
        return reasoning or None, content or None

    def extract_streaming(self, delta: str) -> DeltaMessage | None:
        self.text += delta
        body_start = len(THINK) if self.text.startswith(THINK) else 0
        if body_start == 0 and THINK.startswith(self.text):  # the opening tag, still arriving
            return None
        self.sent = max(self.sent, body_start)
        end = self.text.find(END_THINK, body_start)
        out = DeltaMessage()
        if end < 0:  # still reasoning: all but a possible partial </think>
            stop = len(self.text) - held_back(self.text, END_THINK)
            if stop > self.sent:
                out.reasoning_content = self.text[self.sent:stop]
                self.sent = stop
        else:
            if end > self.sent:
                out.reasoning_content = self.text[self.sent:end]
            after = end + len(END_THINK)
            start = max(self.sent, after)
            if len(self.text) > start:
                out.content = self.text[start:]
            self.sent = len(self.text)
        return out if out.reasoning_content or out.content else None

    def finish(self) -> DeltaMessage | None:
        """The end of the output: a held-back partial ``</think>`` was reasoning after all."""
        if self.sent >= len(self.text) or END_THINK in self.text:
            return None
        rest, self.sent = self.text[max(self.sent, 0):], len(self.text)
        return DeltaMessage(reasoning_content=rest)


class DeepSeekV3ReasoningParser(DeepSeekR1ReasoningParser):
    @staticmethod
    def thinks(chat_template_kwargs: dict | None) -> bool:
        kw = chat_template_kwargs or {}
        return bool(kw.get("thinking", kw.get("enable_thinking", False)))

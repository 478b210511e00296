"""DeepSeek's tool-call formats, written with the tokenizer's special tokens (decoded with
them kept):

- ``deepseek_v3``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n
  ARGS\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``
- ``deepseek_v31``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>...``
- ``deepseek_v32`` / ``deepseek_v4`` (DSML): ``<｜DSML｜function_calls>`` (V4: ``tool_calls``) holding
  ``<｜DSML｜invoke name="NAME">`` with one ``<｜DSML｜parameter name="K" string="true|false">V
  </｜DSML｜parameter>`` per argument (string="false": V is JSON), then ``</｜DSML｜invoke>``.
"""
from __future__ import annotations

import json
import re

from lane.entrypoints.tool_parsers.types import PartialCall, ToolParser, scan_between

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
FENCE = "```"


class _DeepSeekCalls(ToolParser):
    """V3 and V3.1: calls between ``<｜tool▁call▁begin｜>`` and ``<｜tool▁call▁end｜>``."""
    start = CALLS_BEGIN
    keeps_special_tokens = True

    def call(self, seg: str, closed: bool) -> PartialCall | None:
        raise NotImplementedError

    def scan(self, text: str) -> list[PartialCall]:
        return scan_between(text, CALL_BEGIN, CALL_END, self.call)


def _args(raw: str, closed: bool) -> str | None:
    """Arguments text: whole and valid JSON once closed (None if not); while open, all but
    trailing whitespace (the final text is stripped)."""
    if not closed:
        return raw.lstrip().rstrip()
    raw = raw.strip()
    try:
        json.loads(raw)
    except ValueError:
        return None
    return raw


class DeepSeekV3ToolParser(_DeepSeekCalls):
    def call(self, seg: str, closed: bool) -> PartialCall | None:
        _, sep, rest = seg.partition(SEP)
        name, newline, body = rest.partition("\n")
        if not sep or not newline:  # the name is complete at its newline
            return None if closed else PartialCall(None, "", False)
        body = body.lstrip()
        if not closed and (FENCE + "json").startswith(body):  # the opening fence, still arriving
            return PartialCall(name.strip(), "", False)
        if body.startswith(FENCE):  # ```json
            body = body[len(FENCE):]
            body = body[len("json"):] if body.startswith("json") else body
        if closed:
            body = body.rstrip()
            body = body[:-len(FENCE)] if body.endswith(FENCE) else body
        else:  # a closing fence may be arriving
            body = body.rstrip().rstrip("`")
        args = _args(body, closed)
        return None if args is None else PartialCall(name.strip(), args, closed)


class DeepSeekV31ToolParser(_DeepSeekCalls):
    def call(self, seg: str, closed: bool) -> PartialCall | None:
        name, sep, body = seg.partition(SEP)
        if not sep:
            return None if closed else PartialCall(None, "", False)
        args = _args(body, closed)
        return None if args is None else PartialCall(name.strip(), args, closed)


D = "｜DSML｜"
INVOKE = re.compile(rf'<{D}invoke\s+name="([^"]*)"\s*>')
PARAM = re.compile(rf'<{D}parameter\s+name="([^"]*)"(?:\s+string="(true|false)")?\s*>(.*?)</{D}parameter>', re.S)
INVOKE_END = f"</{D}invoke>"


class DeepSeekV32ToolParser(ToolParser):
    """DSML: a call's arguments are sent whole, when its invoke closes (the parameters are
    XML elements; the JSON object exists only once all are read)."""
    start = f"<{D}function_calls>"
    keeps_special_tokens = True

    def scan(self, text: str) -> list[PartialCall]:
        calls, pos = [], 0
        while m := INVOKE.search(text, pos):
            close = text.find(INVOKE_END, m.end())
            if close < 0:
                calls.append(PartialCall(m.group(1), "", False))
                break
            args = {}
            for key, is_string, value in PARAM.findall(text, m.end(), close):
                if is_string == "false":
                    try:
                        args[key] = json.loads(value)
                        continue
                    except ValueError:
                        pass
                args[key] = value
            calls.append(PartialCall(m.group(1), json.dumps(args, ensure_ascii=False), True))
            pos = close + len(INVOKE_END)
        return calls


class DeepSeekV4ToolParser(DeepSeekV32ToolParser):
    start = f"<{D}tool_calls>"

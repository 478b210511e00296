"""Structured outputs on xgrammar (vLLM's ``v1/structured_output``): the output of a request
must match a JSON schema, a regex, a choice, an EBNF grammar or any JSON object.

- ``grammar_of`` builds the xgrammar ``Grammar`` of a ``StructuredOutputsParams`` (no
  tokenizer needed): the API server calls it to refuse a bad schema with a 400 before any
  compute, the engine to compile it.
- ``manager.StructuredOutputManager`` (engine core) compiles grammars for the tokenizer in a
  thread, caches them by spec, keeps each request's matcher and makes each step's token
  bitmask; the sampler applies the bitmask to the constrained rows only.
"""
from __future__ import annotations

import json
import re
from collections import OrderedDict

from lane.sampling_params import ParamError, StructuredOutputsParams


def grammar_of(params: StructuredOutputsParams, param: str = "structured_outputs"):
    """The params' xgrammar Grammar; a ParamError naming ``param`` when it is invalid."""
    import xgrammar as xgr

    kind, spec = params.key
    try:
        if kind == "json_object":  # OpenAI's JSON mode: an object (any JSON value would allow [1])
            return xgr.Grammar.from_json_schema('{"type": "object"}')
        if kind == "json":
            return xgr.Grammar.from_json_schema(spec, strict_mode=True)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in params.choice))
        return xgr.Grammar.from_ebnf(spec)
    except (RuntimeError, ValueError, TypeError) as e:
        what = {"json": "JSON schema", "regex": "regex", "grammar": "EBNF grammar"}.get(kind, kind)
        msg = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip().splitlines()[0])  # xgrammar's source location
        raise ParamError(param, f"invalid {what}: {msg[:300]}") from None


_CHECKED: OrderedDict[tuple[str, str], None] = OrderedDict()  # specs whose grammar builds (LRU)


def check(params: StructuredOutputsParams, param: str = "structured_outputs") -> None:
    """Refuse a spec whose grammar does not build (a ParamError naming ``param``), before it is
    queued: the engine would fail on it mid-step. Specs that passed are remembered (the API
    server checks each twice: its own field name first, then the engine's input check);
    failures are not, so nothing about a bad spec sticks."""
    key = params.key
    if key in _CHECKED:
        _CHECKED.move_to_end(key)
        return
    grammar_of(params, param)
    _CHECKED[key] = None
    while len(_CHECKED) > 256:
        _CHECKED.popitem(last=False)

"""Tool-call and reasoning parsers on fixed model outputs, whole and as streaming deltas
(issue 17's parsers; not yet wired into the server)."""
import json
import random

from lane.entrypoints.tool_parsers import DeepSeekR1ReasoningParser, HermesToolParser

TWO_CALLS = ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
             '"unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
             '{"tz": "Europe/Paris", "nested": {"a": [1, 2, {"b": "}"}]}}}\n</tool_call>')


def _pieces(text: str, seed: int, max_len: int = 4) -> list[str]:
    rng, out, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, max_len)
        out.append(text[i:i + n])
        i += n
    return out


def _stream(parser, pieces):
    content, calls = "", {}
    for p in pieces:
        d = parser.extract_streaming(p)
        if d is None:
            continue
        content += d.content or ""
        for tc in d.tool_calls:
            c = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.name is not None:
                assert c["name"] is None and tc.id  # id and name once, in the call's first delta
                c["id"], c["name"] = tc.id, tc.name
            else:
                assert c["name"] is not None  # arguments only after the name
            c["arguments"] += tc.arguments
    return content, [calls[i] for i in sorted(calls)]


def test_hermes_whole_output():
    content, calls = HermesToolParser.extract(TWO_CALLS)
    assert content == "Let me check both."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "unit": "celsius"}
    assert json.loads(calls[1].arguments)["nested"] == {"a": [1, 2, {"b": "}"}]}
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    assert HermesToolParser.extract("no tools here") == ("no tools here", [])
    assert HermesToolParser.extract("<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [])


def test_hermes_streaming_in_many_small_deltas_equals_whole():
    _, whole = HermesToolParser.extract(TWO_CALLS)
    for seed in range(20):  # the text cut at random places, 1-4 characters a delta
        content, calls = _stream(HermesToolParser(), _pieces(TWO_CALLS, seed))
        assert content.strip() == "Let me check both."  # no part of <tool_call> leaks as text
        assert [c["name"] for c in calls] == ["get_weather", "get_time"]
        for got, want in zip(calls, whole):
            assert json.loads(got["arguments"]) == json.loads(want.arguments)
    # one delta per character
    content, calls = _stream(HermesToolParser(), list(TWO_CALLS))
    assert len(calls) == 2 and json.loads(calls[1]["arguments"])["tz"] == "Europe/Paris"


def test_hermes_streaming_plain_text_passes_through():
    text = "Just an answer with a < sign and <tool"
    content, calls = _stream(HermesToolParser(), _pieces(text, 1))
    assert calls == [] and text.startswith(content) and content.endswith("sign and ")  # "<tool" held back


def test_deepseek_r1_reasoning_whole_and_streaming():
    text = "<think>The user wants 2+2. That is 4.</think>The answer is 4."
    assert DeepSeekR1ReasoningParser.extract(text) == ("The user wants 2+2. That is 4.", "The answer is 4.")
    assert DeepSeekR1ReasoningParser.extract("still thinking") == ("still thinking", None)
    no_open = "Reason first.</think>Then answer."  # the template opened <think> in the prompt
    assert DeepSeekR1ReasoningParser.extract(no_open) == ("Reason first.", "Then answer.")
    for t in (text, no_open):
        for seed in range(10):
            p = DeepSeekR1ReasoningParser()
            reasoning = content = ""
            for piece in _pieces(t, seed, 3):
                d = p.extract_streaming(piece)
                if d is not None:
                    reasoning += d.reasoning_content or ""
                    content += d.content or ""
            assert (reasoning, content) == DeepSeekR1ReasoningParser.extract(t)

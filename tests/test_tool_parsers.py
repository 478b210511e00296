"""Tool-call and reasoning parsers on fixed model outputs, whole and as streaming deltas cut
at random places: Hermes, DeepSeek V3 / V3.1 / V3.2 / V4, forced tool choice, R1 reasoning."""
import json
import random

import pytest

from lane.entrypoints.tool_parsers import (TOOL_PARSERS, DeepSeekR1ReasoningParser, DeepSeekV3ReasoningParser,
                                           HermesToolParser, NamedToolParser, RequiredToolParser)
from lane.entrypoints.tool_parsers.chat_output import ChatOutputParser

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
    content, calls = HermesToolParser().extract(TWO_CALLS)
    assert content == "Let me check both."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris", "unit": "celsius"}
    assert json.loads(calls[1].arguments)["nested"] == {"a": [1, 2, {"b": "}"}]}
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    assert HermesToolParser().extract("no tools here") == ("no tools here", [])
    assert HermesToolParser().extract("<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [])


def test_hermes_streaming_in_many_small_deltas_equals_whole():
    _, whole = HermesToolParser().extract(TWO_CALLS)
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


# -- DeepSeek's formats, written in their special tokens -------------------------------------
B, CB, SEP, CE, E = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>"
WEATHER, TIME = {"city": "Paris", "unit": "celsius"}, {"tz": "Europe/Paris", "nested": {"a": [1, {"b": "}`"}]}}
V3 = (f"Checking.{B}{CB}function{SEP}get_weather\n```json\n{json.dumps(WEATHER)}\n```{CE}\n"
      f"{CB}function{SEP}get_time\n```json\n{json.dumps(TIME)}\n```{CE}{E}")
V31 = f"Checking.{B}{CB}get_weather{SEP}{json.dumps(WEATHER)}{CE}{CB}get_time{SEP}{json.dumps(TIME)}{CE}{E}"


def _dsml(wrapper: str) -> str:
    d = "｜DSML｜"
    return (f"Checking.\n\n<{d}{wrapper}>\n<{d}invoke name=\"get_weather\">\n"
            f"<{d}parameter name=\"city\" string=\"true\">Paris</{d}parameter>\n"
            f"<{d}parameter name=\"unit\" string=\"true\">celsius</{d}parameter>\n</{d}invoke>\n"
            f"<{d}invoke name=\"get_time\">\n<{d}parameter name=\"tz\" string=\"true\">Europe/Paris</{d}parameter>\n"
            f"<{d}parameter name=\"nested\" string=\"false\">{json.dumps(TIME['nested'])}</{d}parameter>\n"
            f"</{d}invoke>\n</{d}{wrapper}>")


@pytest.mark.parametrize("name,text", [("deepseek_v3", V3), ("deepseek_v31", V31),
                                       ("deepseek_v32", _dsml("function_calls")), ("deepseek_v4", _dsml("tool_calls"))])
def test_deepseek_formats_whole_and_streamed(name, text):
    cls = TOOL_PARSERS[name]
    content, calls = cls().extract(text)
    assert content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", WEATHER), ("get_time", TIME)]
    for seed in range(10):  # special tokens cut anywhere, 1-4 characters a delta
        content, streamed = _stream(cls(), _pieces(text, seed))
        assert content.strip() == "Checking."
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [("get_weather", WEATHER),
                                                                             ("get_time", TIME)]
    assert cls().extract("plain answer") == ("plain answer", [])
    broken = text.replace("celsius", 'cel"sius') if name in ("deepseek_v3", "deepseek_v31") else None
    if broken is not None:  # arguments that are not JSON: the output is content, not a call
        assert cls().extract(broken) == (broken, [])
    other = _dsml("function_calls") if name == "deepseek_v4" else _dsml("tool_calls")
    assert cls().extract(other)[1] == []  # another format's output is not a call of this one


def test_forced_tool_choice_outputs():
    """tool_choice required (a JSON array of {name, parameters}) and a named function (its
    arguments), streamed in small deltas: the same calls as parsed whole."""
    text = json.dumps([{"name": "get_weather", "parameters": WEATHER}, {"name": "get_time", "parameters": TIME}],
                      indent=2)
    _, calls = RequiredToolParser().extract(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", WEATHER), ("get_time", TIME)]
    for seed in range(10):
        content, streamed = _stream(RequiredToolParser(), _pieces(text, seed))
        assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in streamed] == \
            [("get_weather", WEATHER), ("get_time", TIME)]
    named = json.dumps(TIME)
    _, calls = NamedToolParser("get_time").extract(named)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", TIME)]
    content, streamed = _stream(NamedToolParser("get_time"), _pieces(named, 3))
    assert streamed[0]["name"] == "get_time" and json.loads(streamed[0]["arguments"]) == TIME


def test_reasoning_then_tools_chained_and_flushed():
    """Reasoning first, then content and tool calls from what follows it; a marker held back
    at the end of the output goes out when it ends."""
    text = "<think>They want Paris' weather.</think>" + TWO_CALLS
    whole = ChatOutputParser(DeepSeekR1ReasoningParser(), HermesToolParser()).parse(text)
    assert whole.reasoning_content == "They want Paris' weather." and whole.content == "Let me check both."
    assert [c.name for c in whole.tool_calls] == ["get_weather", "get_time"]
    for seed in range(5):
        p = ChatOutputParser(DeepSeekR1ReasoningParser(), HermesToolParser())
        pieces = _pieces(text, seed)
        reasoning, content, args = "", "", {}
        for i, piece in enumerate(pieces):
            d = p.delta(piece, i == len(pieces) - 1)
            if d is not None:
                reasoning += d.reasoning_content or ""
                content += d.content or ""
                for tc in d.tool_calls:
                    args[tc.index] = args.get(tc.index, "") + tc.arguments
        assert reasoning == whole.reasoning_content and content.strip() == whole.content
        assert [json.loads(args[i]) for i in sorted(args)] == [json.loads(c.arguments) for c in whole.tool_calls]
        assert p.called_tools
    p = ChatOutputParser(None, HermesToolParser())  # a trailing "<tool" is content after all
    assert p.delta("an answer <tool", False).content == "an answer "
    assert p.delta("", True).content == "<tool"
    assert not DeepSeekV3ReasoningParser.thinks(None) and DeepSeekV3ReasoningParser.thinks({"thinking": True})


@pytest.mark.parametrize("eos_text", [None, "<｜end▁of▁sentence｜>"], ids=["smollm_eos", "deepseek_eos"])
def test_stop_tokens_never_reach_content_when_special_tokens_are_kept(smollm_tokenizer, eos_text):
    """DeepSeek formats decode with special tokens kept (their markers are special tokens); the
    EOS or stop token that ends an answer is still not text (vLLM drops it): a plain answer's
    content, whole and streamed, through the real detokenizer (real token ids of SmolLM2's
    tokenizer, and with DeepSeek's <｜end▁of▁sentence｜> as its EOS) and each DeepSeek parser."""
    import copy

    from lane.engine.messages import EngineCoreOutput
    from lane.engine.output_processor import OutputProcessor
    from lane.sampling_params import SamplingParams

    tok = smollm_tokenizer
    if eos_text is not None:
        tok = copy.deepcopy(tok)
        tok.add_special_tokens({"eos_token": eos_text})
    eos = tok.eos_token_id
    ids = tok.encode("The capital of France is Paris. It lies on the Seine.", add_special_tokens=False)
    prompt = tok.encode("Where is Paris?", add_special_tokens=False)
    for name in ("deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4"):
        assert TOOL_PARSERS[name].keeps_special_tokens  # what the chat route then sets
        for gen, stop_ids, stop_reason in ((ids + [eos], [], None), (ids, [ids[-1]], ids[-1])):
            want = tok.decode(gen[:-1], skip_special_tokens=False)
            params = SamplingParams(max_tokens=64, skip_special_tokens=False, stop_token_ids=stop_ids)
            for stream in (False, True):
                op = OutputProcessor(tok)
                op.add_request("r", None, prompt, params, stream)
                parser, content = ChatOutputParser(None, TOOL_PARSERS[name]()), ""
                for i, t in enumerate(gen):
                    last = i == len(gen) - 1
                    for ro in op.process_outputs([EngineCoreOutput(
                            "r", [t], finish_reason="stop" if last else None,
                            stop_reason=stop_reason if last else None)])[0]:
                        c = ro.outputs[0]
                        if stream:
                            d = parser.delta(c.text, c.finish_reason is not None)
                            content += (d.content or "") if d else ""
                        else:
                            assert c.token_ids == gen  # the stop token is kept in token_ids
                            content = parser.parse(c.text).content
                assert content == want, (name, stream, content)


@pytest.mark.parametrize("text", ["<tool_call>\nweather Paris\n</tool_call>", "Sure. <tool_call>{\"city\": \"Paris\"}",
                                  "<tool_call>\n{\"name\": 3, \"arguments\": {}}\n</tool_call> done"])
def test_hermes_call_that_never_parses_streams_as_content(text):
    """A <tool_call> whose JSON never parses (no call, no name): streamed, its text comes out as
    content at the end and no call was made (finish_reason stop), as the whole output parses."""
    whole = ChatOutputParser(None, HermesToolParser()).parse(text)
    assert whole.tool_calls == [] and whole.content == text
    for seed in range(5):
        p, content = ChatOutputParser(None, HermesToolParser()), ""
        pieces = _pieces(text, seed)
        for i, piece in enumerate(pieces):
            d = p.delta(piece, i == len(pieces) - 1)
            assert d is None or not d.tool_calls
            content += (d.content or "") if d else ""
        assert content == text and not p.called_tools

"""Tool calling and reasoning content through `lane serve` and the openai client, on the
embedded SmolLM2 (a real trained model) with the Hermes-style template from examples/:
tool_choice named and required give arguments valid for the tool's schema (structured
outputs shape them), streamed as OpenAI's tool-call deltas; tool_choice auto finds the calls
the model writes (a few-shot history with tool messages, rendered by the template);
reasoning goes to reasoning_content and a response_format applies after it."""
import json
import os
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import jsonschema
import openai
import pytest

TEMPLATE = os.path.join(os.path.dirname(__file__), "..", "examples", "tool_chat_template_hermes.jinja")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20},
                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20}},
        "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
CITIES = ["Paris", "Tokyo", "Lima", "Cairo", "Oslo"]


@pytest.fixture(scope="module")
def server():
    from utils import RemoteServer

    with RemoteServer(["--dtype", "float32", "--quantization", "none", "--kv-cache-memory-bytes", "128M",
                       "--max-model-len", "2048", "--chat-template", TEMPLATE, "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes", "--reasoning-parser", "deepseek_v3"]) as s:
        c = s.client()
        s.model = c.models.list().data[0].id
        yield s


def _streamed_calls(stream) -> tuple[str, list[dict], str]:
    """(content, calls, finish_reason) joined from a stream's deltas, checking OpenAI's shape:
    a call's id, type and name come once, in its first delta."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.type == "function" and tc.function.name
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and tc.function.name is None
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = ch.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_named_and_required_tool_choice_give_valid_arguments(server):
    c = server.client()
    named = {"type": "function", "function": {"name": "get_weather"}}
    cases = [(city, choice, parallel) for city in CITIES
             for choice, parallel in ((named, True), ("required", False), ("required", True))]

    def kw(city, choice, parallel):
        return dict(model=server.model, messages=[{"role": "user", "content": f"How is the weather in {city} right now?"}],
                    tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=120, parallel_tool_calls=parallel)

    with ThreadPoolExecutor(len(cases)) as pool:  # one batch: float32 greedy, the batch changes nothing
        answers = list(pool.map(lambda case: c.chat.completions.create(**kw(*case)), cases))
        streamed = list(pool.map(lambda case: _streamed_calls(c.chat.completions.create(**kw(*case), stream=True)),
                                 cases[:3]))
    for (city, choice, parallel), r in zip(cases, answers):
        ch = r.choices[0]
        # a named tool_choice finishes with stop (OpenAI, vLLM); required with tool_calls
        assert ch.finish_reason == ("stop" if choice is named else "tool_calls"), ch
        calls = ch.message.tool_calls
        assert calls and (len(calls) == 1 or parallel)
        if choice is named:
            assert [tc.function.name for tc in calls] == ["get_weather"]
        for tc in calls:
            assert tc.id.startswith("call_") and tc.type == "function"
            jsonschema.validate(json.loads(tc.function.arguments), SCHEMAS[tc.function.name])
    for r, (content, calls, finish) in zip(answers, streamed):  # the same calls, in OpenAI's deltas
        assert finish == r.choices[0].finish_reason and not content
        assert [(s["name"], json.loads(s["arguments"])) for s in calls] == \
            [(tc.function.name, json.loads(tc.function.arguments)) for tc in r.choices[0].message.tool_calls]


def _few_shot(question: str) -> list[dict]:
    """Earlier turns where the assistant called the tool and a tool answered."""
    msgs = []
    for i, city in enumerate(["London", "Madrid", "Rome"]):
        msgs += [{"role": "user", "content": f"What's the weather in {city}?"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": f"call_{i}", "type": "function",
                      "function": {"name": "get_weather", "arguments": json.dumps({"city": city, "unit": "celsius"})}}]},
                 {"role": "tool", "tool_call_id": f"call_{i}", "content": "20 C, clear"},
                 {"role": "assistant", "content": f"It is 20 C and clear in {city}."}]
    return msgs + [{"role": "user", "content": question}]


def test_auto_tool_choice_parses_the_models_calls(server):
    c = server.client()
    kw = dict(model=server.model, messages=_few_shot("What's the weather in Paris?"), tools=TOOLS,
              temperature=0, max_tokens=60)
    with ThreadPoolExecutor(3) as pool:  # auto (the default with tools), streamed, and none: one batch
        auto = pool.submit(c.chat.completions.create, **kw)
        stream = pool.submit(lambda: _streamed_calls(c.chat.completions.create(**kw, stream=True)))
        none = pool.submit(c.chat.completions.create, **kw, tool_choice="none")
    ch = auto.result().choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in ch.message.tool_calls] == \
        [("get_weather", {"city": "Paris", "unit": "celsius"})]
    content, streamed, finish = stream.result()
    assert finish == "tool_calls" and content.strip() == ""
    assert [(s["name"], json.loads(s["arguments"])) for s in streamed] == [("get_weather", {"city": "Paris",
                                                                                            "unit": "celsius"})]
    # tool_choice none: the same model output stays text
    r = none.result()
    assert r.choices[0].message.tool_calls == [] and "<tool_call>" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    # /tokenize renders the tools the same way a chat completion does
    tok = httpx.post(server.url + "/tokenize", json={"messages": kw["messages"], "tools": TOOLS}).json()
    assert tok["count"] == r.usage.prompt_tokens and "<tools>" in "".join(tok["token_strs"])


def test_auto_tool_call_that_does_not_parse_is_content(server):
    """The model imitates earlier turns that wrote <tool_call> without JSON: no call parses, so
    the text is content with finish_reason stop, whole and streamed alike."""
    c = server.client()
    msgs = []
    for city in ["London", "Madrid", "Rome"]:
        msgs += [{"role": "user", "content": f"What's the weather in {city}?"},
                 {"role": "assistant", "content": f"<tool_call>\nweather in {city}\n</tool_call>"},
                 {"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "You are welcome."}]
    kw = dict(model=server.model, messages=msgs + [{"role": "user", "content": "What's the weather in Paris?"}],
              tools=TOOLS, temperature=0, max_tokens=30)
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(c.chat.completions.create, **kw)
        stream = pool.submit(lambda: _streamed_calls(c.chat.completions.create(**kw, stream=True)))
    ch = whole.result().choices[0]
    assert "<tool_call>" in ch.message.content and ch.message.tool_calls == [], ch  # the case at stake
    assert ch.finish_reason == "stop"
    assert stream.result() == (ch.message.content, [], "stop")


def _think_shots(question: str) -> list[dict]:
    msgs = []
    for q, thought, answer in [("What is 2+3?", "2 plus 3 makes 5.", "5"),
                               ("What is the capital of Italy?", "Italy's capital city is Rome.", "Rome"),
                               ("How many legs does a cat have?", "A cat is a quadruped, so four.", "4")]:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": f"<think>{thought}</think>{answer}"}]
    return msgs + [{"role": "user", "content": question}]


def test_reasoning_content_then_structured_output(server):
    c = server.client()
    msgs = _think_shots("What is the capital of France?")
    think = {"chat_template_kwargs": {"thinking": True}}
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}},
              "required": ["answer"], "additionalProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "Answer", "schema": schema}}
    kw = dict(model=server.model, messages=msgs, temperature=0, max_tokens=60, response_format=rf, extra_body=think)

    def streamed():
        reasoning = content = ""
        for chunk in c.chat.completions.create(**kw, stream=True):
            if chunk.choices:
                reasoning += getattr(chunk.choices[0].delta, "reasoning_content", None) or ""
                content += chunk.choices[0].delta.content or ""
        return reasoning, content

    with ThreadPoolExecutor(4) as pool:  # one batch (float32 greedy: it changes nothing)
        free = pool.submit(c.chat.completions.create, model=server.model, messages=msgs, temperature=0,
                           max_tokens=60, extra_body=think)
        plain = pool.submit(c.chat.completions.create, model=server.model, messages=msgs, temperature=0, max_tokens=60)
        constrained = pool.submit(c.chat.completions.create, **kw)
        stream = pool.submit(streamed)
    free = free.result().choices[0].message
    assert free.reasoning_content == "The capital of France is Paris." and free.content == "Paris"
    # without thinking turned on (deepseek_v3's switch), it is all content
    assert plain.result().choices[0].message.content.startswith("<think>")
    # a schema applies after </think>: the reasoning is the free one, the answer is JSON
    m = constrained.result().choices[0].message
    assert m.reasoning_content == free.reasoning_content
    jsonschema.validate(json.loads(m.content), schema)
    assert stream.result() == (m.reasoning_content, m.content)


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objec"}}}],
      "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
                                                        "function": {"name": "f", "arguments": "{no"}}]}]}, "messages"),
])
def test_bad_tool_requests_are_400(server, body, param):
    c = server.client()
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=server.model, max_tokens=4, **body)
    assert e.value.body["param"] == param, e.value.body

"""Structured outputs on xgrammar, on the embedded SmolLM2 (a real trained model): every
output of a JSON schema validates, of a regex matches, of a choice is one; free requests
batched with constrained ones keep their text; the openai client's parse() round-trips;
streaming joins to the same text; a bad schema / regex / grammar is a 400 naming its field;
a grammar still compiling holds back its own request only."""
import json
import re
import threading
import time

import jsonschema
import openai
import pytest

from lane import LLM, SamplingParams
from lane.sampling_params import StructuredOutputsParams as SO

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "teacher", "doctor", "artist"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "skills", "address"],
    "additionalProperties": False,
}
TOPICS = ["a nurse", "a pilot", "a painter", "a chef", "a teacher in Lyon", "a young coder", "an old farmer",
          "a doctor", "a singer", "a sailor", "a baker", "a judge", "a miner", "a poet", "a tailor", "a nun",
          "a drummer", "a clerk", "a guide", "a monk"]
DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"


def chat(llm, text):
    return {"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": text}])}


@pytest.fixture(scope="module")
def llm(smollm_gguf):
    return LLM(smollm_gguf, dtype="float32", quantization="none", kv_cache_memory_bytes=256 << 20,
               max_model_len=1024, show_progress=False)


def test_json_schema_every_output_validates(llm):
    prompts = [chat(llm, f"Describe {t} as a JSON object with name, age, role, skills and address.")
               for t in TOPICS]
    sp = SamplingParams(temperature=0, max_tokens=120, structured_outputs=SO(json=PERSON))
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert len(outs) == 20
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c.text  # cut by the length limit counts as a failure
        jsonschema.validate(json.loads(c.text), PERSON)
    # sampled too: every draw still fits
    sp = SamplingParams(temperature=1.0, max_tokens=120, seed=3, structured_outputs=SO(json=PERSON))
    for o in llm.generate(prompts[:6], sp, use_tqdm=False):
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)


def test_regex_choice_json_object_and_free_neighbours(llm):
    qs = ["When did the first moon landing happen?", "When was the Eiffel Tower finished?", "What is today's date?"]
    free_alone = [o.outputs[0].text for o in llm.generate(
        [chat(llm, q) for q in qs], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)]
    cases = [SO(regex=DATE), SO(choice=["yes", "no", "maybe"]), SO(json_object=True)]
    prompts, params = [], []
    for q in qs:  # a free request next to each constrained one, in one batch
        for so in cases:
            ask = q + (" Answer as a JSON object with the key 'answer'." if so.json_object else "")
            prompts.append(chat(llm, ask))
            params.append(SamplingParams(temperature=0, max_tokens=80, structured_outputs=so))
        prompts.append(chat(llm, q))
        params.append(SamplingParams(temperature=0, max_tokens=24))
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for i, q in enumerate(qs):
        date, choice, obj, free = outs[4 * i:4 * i + 4]
        assert re.fullmatch(DATE, date.text), date.text
        assert choice.text in ("yes", "no", "maybe")
        assert isinstance(json.loads(obj.text), dict)
        assert free.text == free_alone[i]  # float32 greedy: the batch changes nothing


def test_chunked_prefill_prefix_cache_and_n_keep_the_constraint(llm, smollm_gguf):
    """A prompt prefilled in 16-token chunks, then served again from the prefix cache, gives the
    same greedy JSON as one whole prefill (float32); n = 3 sampled choices each validate."""
    story = " ".join(f"{t} met {u} at the market and they talked about the weather."
                     for t, u in zip(TOPICS, TOPICS[1:8]))
    prompt = chat(llm, story + " Describe the first person as a JSON object.")
    assert len(prompt["prompt_token_ids"]) > 100
    sp = SamplingParams(temperature=0, max_tokens=120, structured_outputs=SO(json=PERSON))
    want = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].text
    jsonschema.validate(json.loads(want), PERSON)
    chunked = LLM(smollm_gguf, dtype="float32", quantization="none", kv_cache_memory_bytes=64 << 20,
                  max_model_len=1024, max_num_batched_tokens=16, show_progress=False)
    first = chunked.generate([prompt], sp, use_tqdm=False)[0]
    assert first.outputs[0].text == want and first.num_cached_tokens == 0
    again, sampled = chunked.generate([prompt, prompt], [sp, SamplingParams(
        n=3, temperature=1.0, seed=5, max_tokens=120, structured_outputs=SO(json=PERSON))], use_tqdm=False)
    assert again.outputs[0].text == want and again.num_cached_tokens >= 96  # whole blocks of the prompt
    assert len(sampled.outputs) == 3
    for c in sampled.outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)


def test_a_complete_grammar_ends_the_answer_despite_min_tokens(llm):
    """min_tokens masks EOS; a grammar that allows only stopping must still win (else a token it
    forbids is sampled), greedy or not, and the answer ends with the grammar."""
    for temperature in (0, 1.0):
        out = llm.generate([chat(llm, "Is the sky blue?")], SamplingParams(
            temperature=temperature, seed=3, max_tokens=20, min_tokens=10,
            structured_outputs=SO(choice=["yes", "no"])), use_tqdm=False)[0].outputs[0]
        assert out.text in ("yes", "no"), out.text
        assert out.finish_reason == "stop"


def test_a_bad_grammar_is_refused_before_queueing_and_no_failure_is_cached(llm):
    """LLM.generate checks every spec before queueing anything: a regex that does not build is a
    ValueError naming the field, and nothing is left in the engine. A compile that fails in the
    engine all the same is not cached: the next request with that spec compiles it again."""
    from lane.engine.messages import EngineCoreRequest

    prompt = chat(llm, "When did the first moon landing happen?")
    with pytest.raises(ValueError) as e:
        llm.generate([prompt, prompt], [SamplingParams(max_tokens=8, structured_outputs=SO(regex=DATE)),
                                        SamplingParams(max_tokens=8, structured_outputs=SO(regex="(("))],
                     use_tqdm=False)
    assert e.value.param == "structured_outputs" and "regex" in str(e.value)
    assert not llm.engine.has_unfinished_requests() and not llm.output_processor.has_unfinished()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, structured_outputs=SO(regex=DATE)),
                       use_tqdm=False)[0].outputs[0]
    assert re.fullmatch(DATE, out.text), out.text
    # past the check (straight into the engine), the compile fails: the request fails, the cache keeps nothing
    manager = llm.engine.scheduler.structured_output
    bad = SO(regex="((")
    for rid in ("bad-1", "bad-2"):
        llm.engine.add_request(EngineCoreRequest(rid, prompt["prompt_token_ids"], SamplingParams(
            max_tokens=4, structured_outputs=bad)))
        manager.pending[rid][1].exception(timeout=30)  # compiled (and failed)
        with pytest.raises(ValueError, match="failed to compile"):
            llm.engine.step()
        assert bad.key not in manager.cache
        llm.engine.abort_requests([rid])
    assert not llm.engine.has_unfinished_requests()


def test_a_compiling_grammar_holds_back_only_its_request(smollm_gguf):
    """The compile thread is kept busy: the constrained request waits, the free one decodes;
    once the thread is free the constrained one runs and its output matches. The first
    structured request's tokenizer tables are built in that thread too, not in the engine's
    loop (~1 s that stalled every stream)."""
    from lane.engine.messages import EngineCoreRequest

    llm = LLM(smollm_gguf, kv_cache_memory_bytes=64 << 20, max_model_len=512, show_progress=False)
    tok = llm.get_tokenizer()
    t0 = time.perf_counter()
    llm.engine.add_request(EngineCoreRequest("w", tok.encode("warm"), SamplingParams(
        max_tokens=1, structured_outputs=SO(regex="a"))))
    assert time.perf_counter() - t0 < 0.3  # the engine loop goes on at once
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    manager = llm.engine.scheduler.structured_output
    gate = threading.Event()
    manager.pool.submit(gate.wait)  # the one compile thread, busy
    try:
        llm.engine.add_request(EngineCoreRequest("c", tok.encode("The year is"), SamplingParams(
            temperature=0, max_tokens=8, structured_outputs=SO(regex=r" \d{4}"))))
        llm.engine.add_request(EngineCoreRequest("f", tok.encode("Once upon a time"),
                                                 SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)))
        done = set()
        for _ in range(12):
            done |= {o.request_id for o in llm.engine.step() if o.finish_reason is not None}
        assert done == {"f"}  # the free request finished while the grammar waited
        assert [r.request_id for r in llm.engine.scheduler.waiting] == ["c"]
    finally:
        gate.set()
    text, deadline = [], time.monotonic() + 60
    while llm.engine.has_unfinished_requests() and time.monotonic() < deadline:  # the compile runs now
        for out in llm.engine.step():
            text += out.new_token_ids
    assert re.fullmatch(r" \d{4}", tok.decode(text, skip_special_tokens=True))


@pytest.fixture(scope="module")
def server(plain_server):
    return plain_server


def test_openai_parse_and_streaming(server):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)
        population_millions: int

    c = server.client()
    model = c.models.list().data[0].id
    msgs = [{"role": "user", "content": "Give me a large city as JSON."}]
    r = c.chat.completions.parse(model=model, messages=msgs, response_format=City, temperature=0, max_tokens=80)
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and r.choices[0].finish_reason == "stop"
    # the same request streamed: the deltas join to the same text
    schema = {"type": "json_schema", "json_schema": {"name": "City", "schema": City.model_json_schema(),
                                                       "strict": True}}
    full = c.chat.completions.create(model=model, messages=msgs, response_format=schema, temperature=0,
                                     max_tokens=80).choices[0].message.content
    stream = c.chat.completions.create(model=model, messages=msgs, response_format=schema, temperature=0,
                                       max_tokens=80, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == full
    assert City.model_validate_json(full) == city
    # completions, with vLLM's fields
    r = c.completions.create(model=model, prompt="The war ended in the year", max_tokens=8, temperature=0,
                             extra_body={"structured_outputs": {"regex": r" \d{4}"}})
    assert re.fullmatch(r" \d{4}", r.choices[0].text)
    r = c.completions.create(model=model, prompt="Is water wet? Answer:", max_tokens=8, temperature=0,
                             extra_body={"guided_choice": [" yes", " no"]})
    assert r.choices[0].text in (" yes", " no")


@pytest.mark.parametrize("body,param", [
    ({"guided_regex": "(("}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_bad_constraints_are_400_naming_the_field(server, body, param):
    c = server.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=c.models.list().data[0].id, prompt="x", max_tokens=4, extra_body=body)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body


def test_unknown_fields_are_logged_and_counted(server):
    """Fields lane does not implement are not silently dropped: a warning names them and
    /metrics counts them per field."""
    import httpx2 as httpx

    from utils import metric

    c = server.client()
    c.completions.create(model=c.models.list().data[0].id, prompt="Hi", max_tokens=2,
                         extra_body={"best_of_everything": 3, "tool_choice": "auto"})
    text = httpx.get(server.url + "/metrics").text
    assert metric(text, "lane:request_ignored_fields_total", field="best_of_everything") >= 1
    assert metric(text, "lane:request_ignored_fields_total", field="tool_choice") >= 1
    assert "fields were present in the request but ignored: best_of_everything, tool_choice" in server.read_log()


def test_nested_unknown_fields_and_strict_false_are_said(server):
    """Unknown keys inside structured_outputs / response_format, and json_schema.strict false
    (lane enforces every schema strictly), are warned about and counted like top-level ones."""
    import httpx2 as httpx

    from utils import metric

    c = server.client()
    model = c.models.list().data[0].id
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "JSON please"}], max_tokens=40,
                                  temperature=0, response_format={"type": "json_schema", "json_schema": {
                                      "name": "A", "schema": schema, "strict": False, "colour": "red"}})
    assert isinstance(json.loads(r.choices[0].message.content)["a"], int)
    c.completions.create(model=model, prompt="The year", max_tokens=6, temperature=0,
                         extra_body={"structured_outputs": {"regex": r" \d{4}", "whitespace_pattern": " "}})
    text = httpx.get(server.url + "/metrics").text
    for field in ("response_format.json_schema.strict", "response_format.json_schema.colour",
                  "structured_outputs.whitespace_pattern"):
        assert metric(text, "lane:request_ignored_fields_total", field=field) >= 1, field
    log = server.read_log()
    assert "ignored: response_format.json_schema.colour, response_format.json_schema.strict" in log
    assert "ignored: structured_outputs.whitespace_pattern" in log

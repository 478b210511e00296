"""`lane serve` end to end: the real server in a subprocess, the real openai client,
real HTTP on loopback; greedy float32 output checked against the offline LLM."""
import asyncio
import re
import time

import httpx2 as httpx
import pytest

from lane import SamplingParams
from conftest import PROMPTS
from utils import metric

MODEL = "smollm"  # conftest's plain_server


@pytest.fixture(scope="module")
def server(plain_server):
    return plain_server


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def offline(llm, prompts, max_tokens=24, **kw):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]



def test_basic_endpoints(server, smollm_tokenizer):
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["max_model_len"] == 2048
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]
    tok = httpx.post(server.url + "/tokenize", json={"prompt": "Once upon a time"}).json()
    assert tok["tokens"] == smollm_tokenizer.encode("Once upon a time") and tok["count"] == len(tok["tokens"])
    chat_tok = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat_tok["count"] > 3
    assert httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == \
        "Once upon a time"


def test_completions_match_offline(client, lane_smollm_fp32):
    want = offline(lane_smollm_fp32, PROMPTS)
    for prompt, expected in zip(PROMPTS, want):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert r.choices[0].text == expected
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.completion_tokens <= 24 and r.usage.prompt_tokens > 0
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                           stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == expected


def test_batched_prompts_and_token_ids(client, lane_smollm_fp32, smollm_tokenizer):
    want = offline(lane_smollm_fp32, PROMPTS[:2], max_tokens=8)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=8, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want
    ids = smollm_tokenizer.encode(PROMPTS[0])
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, echo=True)
    assert r.choices[0].text == PROMPTS[0] + want[0]


def test_chat_paris_and_matches_offline(client, lane_smollm_fp32):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    text = r.choices[0].message.content
    assert "Paris" in text and r.choices[0].message.role == "assistant"
    want = lane_smollm_fp32.chat(messages, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert text == want[0].outputs[0].text
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason


def test_per_request_timing_when_asked(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True, "return_timing": True})
    t = r.model_extra["timing"]
    assert set(t) == {"queue_ms", "prefill_ms", "decode_ms", "ttft_ms", "e2e_ms", "mean_itl_ms"}
    assert 0 < t["ttft_ms"] <= t["e2e_ms"] and t["decode_ms"] > 0
    assert t["mean_itl_ms"] == pytest.approx(t["decode_ms"] / 5, rel=1e-3)
    assert "timing" not in client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).model_extra
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, stream=True, extra_body={"return_timing": True}))
    assert chunks[-1].choices == [] and chunks[-1].model_extra["timing"]["ttft_ms"] > 0


def test_stop_strings_never_leak(client):
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24,
                                     temperature=0).choices[0].text
    assert " city" in full
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
                                  stop=[" city", "zzz"])
    assert r.choices[0].text == full[:full.index(" city")]
    assert r.choices[0].finish_reason == "stop"
    deltas = [c.choices[0] for c in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0, stop=" city", stream=True)
        if c.choices]
    assert "".join(d.text for d in deltas) == r.choices[0].text
    assert deltas[-1].finish_reason == "stop"


def test_utf8_streams_whole_characters(client):
    for prompt in ["你好，世界！你好，世界！你好，世界！你好，", "I love pizza 🍕🍕🍕 and tacos 🌮🌮🌮. I love sushi"]:
        full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0).choices[0].text
        deltas = [c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True) if c.choices]
        assert any(ord(ch) > 0x2E80 for ch in full)  # CJK or emoji came out
        assert "".join(deltas) == full
        assert all("\ufffd" not in d for d in deltas)


def test_n_seed_logprobs(client):
    kw = dict(model=MODEL, prompt="The three primary colors are", max_tokens=8, temperature=1.0, seed=7, n=3)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: repeatable
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) >= 3 and max(t.values()) <= 0 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    # greedy: the chosen token is the most likely one
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)
    # return_tokens_as_token_ids (vLLM's): the same tokens named by id, the text unchanged
    ids = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=3,
                                    extra_body={"return_tokens_as_token_ids": True}).choices[0]
    assert ids.text == r.choices[0].text
    assert all(t.startswith("token_id:") for t in ids.logprobs.tokens + [k for d in ids.logprobs.top_logprobs for k in d])
    assert ids.logprobs.token_logprobs == pytest.approx(lp.token_logprobs)


def test_32_concurrent_streams_match_offline(server, lane_smollm_fp32):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(32)]
    want = offline(lane_smollm_fp32, prompts, max_tokens=16)

    async def one(c, prompt):
        stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True)
        return "".join([ch.choices[0].text async for ch in stream if ch.choices])

    async def run():
        c = server.async_client()
        return await asyncio.gather(*(one(c, p) for p in prompts))

    assert asyncio.run(run()) == want


BAD_INPUTS = [
    # (path, json body or raw text, status, error type, param)
    ("/v1/completions", '{"prompt": "hi", "max_tokens": ', 400, "BadRequestError", None),
    ("/v1/completions", {"max_tokens": 4}, 400, "BadRequestError", "prompt"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "BadRequestError", "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "BadRequestError", "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "BadRequestError", "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400, "BadRequestError", "top_k"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "BadRequestError", "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "BadRequestError", "logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "BadRequestError", "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 5000}, 400, "BadRequestError", "max_tokens"),
    ("/v1/completions", {"prompt": "hi " * 2100}, 400, "BadRequestError", "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "BadRequestError", "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**7]}, 400, "BadRequestError", "prompt"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400, "BadRequestError", "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "NotFoundError", "model"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, 400, "BadRequestError", "stop"),
    ("/v1/chat/completions", {"messages": []}, 400, "BadRequestError", "messages"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "BadRequestError", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "BadRequestError", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 30,
                              "logprobs": True}, 400, "BadRequestError", "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "min_p": 2}, 400,
     "BadRequestError", "min_p"),
    ("/v1/chat/completions", "[1, 2]", 400, "BadRequestError", None),
    ("/detokenize", {"tokens": [-1]}, 400, "BadRequestError", "tokens"),
    ("/v1/nope", {}, 404, "NotFoundError", None),
]


@pytest.mark.parametrize("path,body,status,etype,param", BAD_INPUTS)
def test_bad_input(server, path, body, status, etype, param):
    if isinstance(body, str):
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(server.url + path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == etype and err["code"] == status and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if path == "/v1/completions" and param == "prompt" and status == 400 and "hi hi" in str(body):
        assert "2048" in err["message"] and re.search(r"\b\d{4}\b tokens", err["message"])


def test_metrics(server, client):
    client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    text = httpx.get(server.url + "/metrics").text
    assert metric(text, "vllm:cache_config_info", block_size="16", model_name=MODEL) == 1
    assert metric(text, "vllm:prompt_tokens_total", model_name=MODEL) > 0
    assert metric(text, "vllm:generation_tokens_total") >= 5
    assert metric(text, "vllm:request_success_total", finished_reason="length") >= 1
    for h in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds"):
        assert metric(text, f"vllm:{h}_count") >= 1, h
    for g in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
              "prefix_cache_queries_total", "prefix_cache_hits_total"):
        metric(text, f"vllm:{g}")
    # the same prompt again hits the prefix cache (3 full blocks of 16 tokens)
    before = metric(text, "vllm:prefix_cache_hits_total")
    long_prompt = PROMPTS[3]
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2, temperature=0)
    after = metric(httpx.get(server.url + "/metrics").text, "vllm:prefix_cache_hits_total")
    assert after - before >= 32


def test_continuous_usage_stats_in_every_chunk(client):
    """stream_options.continuous_usage_stats (with include_usage): every chunk carries the usage
    so far; its completion tokens grow to the final usage chunk's."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    for create, kw in ((client.completions.create, dict(prompt=PROMPTS[0])),
                       (client.chat.completions.create, dict(messages=[{"role": "user", "content": "Hi!"}]))):
        chunks = list(create(model=MODEL, max_tokens=12, temperature=0, stream=True, stream_options=opts,
                             extra_body={"ignore_eos": True}, **kw))
        final = chunks[-1].usage
        assert not chunks[-1].choices and final.completion_tokens == 12
        seen = [ch.usage for ch in chunks[:-1]]
        assert all(u is not None and u.prompt_tokens == final.prompt_tokens for u in seen)
        counts = [u.completion_tokens for u in seen]
        assert counts == sorted(counts) and counts[-1] == 12
        assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in seen)
    # without it, only the last chunk has usage
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}))
    assert [ch.usage is not None for ch in chunks] == [False] * (len(chunks) - 1) + [True]


def test_disconnect_frees_kv_blocks(server):
    idle = metric(httpx.get(server.url + "/metrics").text, "vllm:kv_cache_usage_perc")
    aborted = metric(httpx.get(server.url + "/metrics").text, "vllm:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 1500, "ignore_eos": True, "stream": True,
            "temperature": 0}
    with httpx.Client(timeout=60) as h:
        streams = [h.stream("POST", server.url + "/v1/completions", json={**body, "seed": i}) for i in range(4)]
        responses = [s.__enter__() for s in streams]
        # a few tokens each (the line iterators are kept: dropping one closes its response)
        line_iters = [r.iter_lines() for r in responses]
        for lines in line_iters:
            for _ in range(6):
                next(lines)
        deadline = time.monotonic() + 5  # the gauges follow the engine's stats, a step behind
        while True:
            text = httpx.get(server.url + "/metrics").text
            if metric(text, "vllm:num_requests_running") == 4 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert metric(text, "vllm:kv_cache_usage_perc") > idle
        assert metric(text, "vllm:num_requests_running") == 4
        for s in streams:
            s.__exit__(None, None, None)
    # a non-streaming client that gives up (read timeout) is noticed too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, timeout=2)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = httpx.get(server.url + "/metrics").text
        if metric(text, "vllm:num_requests_running") == 0 and metric(text, "vllm:kv_cache_usage_perc") == idle:
            break
        time.sleep(0.2)
    assert metric(text, "vllm:num_requests_running") == 0
    assert metric(text, "vllm:kv_cache_usage_perc") == idle
    # the 5 requests whose clients left count as finished with reason abort (vLLM's label)
    assert metric(text, "vllm:request_success_total", finished_reason="abort") - aborted == 5

"""Faults and overload against real `lane serve` subprocesses on loopback: a KV pool far
too small for the load, clients that hang up, an engine killed mid-stream, an API server
killed under load, and schema fuzzing of the OpenAI routes. A tiny random Llama
(float32, greedy, one thread) keeps it fast: the point is the server's behaviour.

Every loop is bounded and every wait has a deadline, so a failure fails, never hangs.
Each test prints a `[figures]` line (run with -s to see them)."""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time

import httpx2 as httpx
import openai
import pytest

from utils import RemoteServer, metric, pid_alive

# 8 distinct prompts of about 10 tokens
PROMPTS = [f"{opening} {i}:" for i, opening in enumerate((
    "Once upon a time", "The three primary colors are", "Write a poem about the sea", "In computer science",
    "The capital of France is", "My favourite recipe", "A hash table is", "Tell me a story about robots"))]

# KV bytes of one 16-token block of the tiny Llama in float32: K and V x 2 layers x 2 KV heads
# x head_dim 16 x 4 bytes x 16 tokens
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16
MODEL = "tiny"
COMMON = ["--served-model-name", MODEL, "--dtype", "float32",
          "--threads", "1"]  # two torch threads on 2 shared cores spin more than they work
CONFIGS = {
    # 64 blocks = 1,024 tokens: about 4 requests of 10 + 200 tokens (the null block is the 65th)
    "pool4": [*COMMON, "--max-model-len", "1024", "--max-num-batched-tokens", "256",
              "--kv-cache-memory-bytes", str(65 * BLOCK_BYTES)],
    # 2 running and 4 waiting at most: overload is reached at once
    "small": [*COMMON, "--max-model-len", "128", "--kv-cache-memory-bytes", "16M", "--max-num-seqs", "2",
              "--max-num-waiting-requests", "4"],
}


class Servers:
    """One running server per configuration, shared by the tests that leave it as they
    found it; a test that kills part of one takes it (the next to ask starts a fresh one)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.running: dict[str, RemoteServer] = {}
        self.solo: dict[tuple[str, int], list[str]] = {}

    def get(self, name: str) -> RemoteServer:
        if name not in self.running:
            self.running[name] = RemoteServer(["--model", self.model, *CONFIGS[name]])
        return self.running[name]

    def take(self, name: str) -> RemoteServer:
        server = self.get(name)
        del self.running[name]
        self.solo = {k: v for k, v in self.solo.items() if k[0] != name}
        return server

    def solo_texts(self, name: str, max_tokens: int) -> list[str]:
        """Each prompt's greedy text, run alone on that server."""
        key = (name, max_tokens)
        if key not in self.solo:
            s = self.get(name)
            with httpx.Client(timeout=60) as h:
                self.solo[key] = [h.post(s.url + "/v1/completions", json=body(p, max_tokens)).json()
                                  ["choices"][0]["text"] for p in PROMPTS]
        return self.solo[key]

    def close(self) -> None:
        for s in self.running.values():
            s.__exit__(None, None, None)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from lane.entrypoints.tiny_model import write_tiny_model

    s = Servers(write_tiny_model("llama", str(tmp_path_factory.mktemp("tiny-llama"))))
    yield s
    s.close()


def body(prompt: str, max_tokens: int, **kw) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **kw}


def metrics(s: RemoteServer) -> str:
    return httpx.get(s.url + "/metrics", timeout=10).text


def wait_idle(s: RemoteServer, timeout_s: float = 10.0) -> str:
    """/metrics once the engine reports nothing running, nothing waiting and no KV in use."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = metrics(s)
        busy = [metric(text, f"vllm:{g}") for g in ("num_requests_running", "num_requests_waiting",
                                                      "kv_cache_usage_perc")]
        if not any(busy):
            return text
        assert time.monotonic() < deadline, f"not idle after {timeout_s} s: running, waiting, KV = {busy}"
        time.sleep(0.2)


def error_event(line: str) -> dict | None:
    """The error object of an SSE `data:` line, if it carries one."""
    if not line.startswith("data: {"):
        return None
    return json.loads(line[6:]).get("error")


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"]
    return err


def test_overload_preempts_and_every_stream_matches_its_solo_run(servers):
    s = servers.get("pool4")
    text = metrics(s)
    assert metric(text, "vllm:cache_config_info", num_gpu_blocks="64") == 1  # ~4 requests of 210 tokens
    preempted_before = metric(text, "vllm:num_preemptions_total")
    want = servers.solo_texts("pool4", 200)

    async def one(c: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        stream = await c.completions.create(model=MODEL, prompt=PROMPTS[i % 8], max_tokens=200, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
        parts, usage = [], 0
        async for chunk in stream:
            parts.extend(ch.text for ch in chunk.choices)
            usage = chunk.usage.completion_tokens if chunk.usage else usage
        return "".join(parts), usage

    async def run() -> list:
        async with s.async_client(timeout=150) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(64)), return_exceptions=True),
                                          180)

    t0 = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - t0
    errors = [r for r in results if isinstance(r, BaseException)]
    completed = [r for r in results if not isinstance(r, BaseException)]
    text = wait_idle(s)
    preemptions = metric(text, "vllm:num_preemptions_total") - preempted_before
    print(f"\n[figures] overload: sent 64, completed {len(completed)}, refused 0, errored {len(errors)}, "
          f"preemptions {preemptions:.0f}, {elapsed:.1f} s")
    assert not errors, errors[:3]
    assert [t for t, _ in results] == [want[i % 8] for i in range(64)]
    assert all(n == 200 for _, n in results)
    assert preemptions > 0
    assert metric(text, "vllm:num_requests_refused_total") == 0


def test_clients_that_hang_up_leave_the_rest_unchanged_and_kv_idle(servers):
    s = servers.get("pool4")
    want = servers.solo_texts("pool4", 48)
    rng = random.Random(0)
    hang_ups = set(rng.sample(range(64), 7))  # 10% of 64 clients, streaming and not
    # (lines to read, or seconds to wait, before hanging up); asking for 900 tokens, a
    # client that hangs up surely does so mid-request
    plans = {i: (rng.randint(0, 20), rng.uniform(0.05, 1.0)) for i in hang_ups}

    async def completes(c: openai.AsyncOpenAI, i: int) -> str:
        kw = dict(model=MODEL, prompt=PROMPTS[i % 8], max_tokens=48, temperature=0,
                  extra_body={"ignore_eos": True})
        if i % 2:
            return "".join([ch.choices[0].text async for ch in await c.completions.create(stream=True, **kw)
                            if ch.choices])
        return (await c.completions.create(**kw)).choices[0].text

    async def hangs_up(h: httpx.AsyncClient, i: int) -> str:
        chunks, delay = plans[i]
        req = body(PROMPTS[i % 8], 900, stream=bool(i % 2))
        if not i % 2:  # gives up waiting for the whole answer
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(h.post(s.url + "/v1/completions", json=req), delay)
            return "gave up"
        async with h.stream("POST", s.url + "/v1/completions", json=req) as r:
            lines = r.aiter_lines()
            for _ in range(chunks):  # data lines and the blank lines between them
                await anext(lines)
        return "hung up"

    async def run() -> list:
        async with s.async_client(timeout=120) as c, httpx.AsyncClient(timeout=60) as h:
            tasks = [hangs_up(h, i) if i in hang_ups else completes(c, i) for i in range(64)]
            return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 150)

    results = asyncio.run(run())
    errors = [r for r in results if isinstance(r, BaseException)]
    t0 = time.monotonic()
    wait_idle(s)
    print(f"\n[figures] disconnects: sent 64, completed {64 - len(hang_ups) - len(errors)}, hung up "
          f"{len(hang_ups)}, refused 0, errored {len(errors)}, idle {time.monotonic() - t0:.1f} s after the last")
    assert not errors, errors[:3]
    assert [r for i, r in enumerate(results) if i not in hang_ups] == \
        [want[i % 8] for i in range(64) if i not in hang_ups]


def test_overload_is_refused_with_503_and_retry_after(servers):
    s = servers.get("small")
    refused_before = metric(metrics(s), "vllm:num_requests_refused_total")

    async def one(h: httpx.AsyncClient, i: int) -> httpx.Response:
        return await h.post(s.url + "/v1/completions", json=body(PROMPTS[i % 8], 100))

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as h:
            return await asyncio.wait_for(asyncio.gather(*(one(h, i) for i in range(48))), 120)

    responses = asyncio.run(run())
    codes = [r.status_code for r in responses]
    refused = [r for r in responses if r.status_code == 503]
    completed = codes.count(200)
    refused_metric = metric(wait_idle(s), "vllm:num_requests_refused_total") - refused_before
    print(f"\n[figures] refusals: sent 48, completed {completed}, refused {len(refused)}, "
          f"errored {48 - completed - len(refused)}")
    assert completed + len(refused) == 48, codes
    assert completed >= 4 and refused  # an empty queue takes 4 at least
    for r in refused:
        err = assert_openai_error(r, 503)
        assert err["type"] == "ServiceUnavailableError" and "overloaded" in err["message"]
        assert int(r.headers["retry-after"]) >= 1
    assert refused_metric == len(refused)
    assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in responses if r.status_code == 200)
    # a request that could never fit the queue is the client's error, not overload
    err = assert_openai_error(httpx.post(s.url + "/v1/completions", json={**body("hi", 4), "n": 5}), 400)
    assert err["param"] == "n"


def test_balancer_sends_only_where_there_is_room():
    from lane.engine.dp_balancer import DPLoadBalancer, EngineOverloadedError

    b = DPLoadBalancer(2, max_waiting=4)
    b.update(0, waiting=3, running=0)  # score 12
    b.update(1, waiting=1, running=20)  # score 24, but room for 3
    assert b.choose(num_requests=2) == 1  # engine 0 scores lower but cannot take 2
    assert b.choose() == 0 and b.loads[0].waiting == 4
    with pytest.raises(EngineOverloadedError) as e:
        b.choose(num_requests=2)  # 4 and 3 waiting: neither has room for 2
    assert e.value.engine_index == 0 and e.value.limit == 4
    with pytest.raises(EngineOverloadedError):
        b.choose(data_parallel_rank=0)  # a pinned request waits for its own engine only
    b.release(1, 2)
    assert b.choose(data_parallel_rank=1, num_requests=3) == 1


OPENAI_ROUTES = [("/v1/completions", "POST"), ("/v1/chat/completions", "POST"), ("/v1/models", "GET")]


@pytest.mark.parametrize("path,method", OPENAI_ROUTES, ids=[f"{m} {p}" for p, m in OPENAI_ROUTES])
def test_schema_fuzzing_gives_no_5xx_and_openai_error_bodies(servers, path, method):
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis.generation import GenerationMode

    s = servers.get("small")
    schema = schemathesis.openapi.from_url(s.url + "/openapi.json")
    operation = schema[path][method]
    has_input = operation.body or any(True for _ in operation.iter_parameters())
    seen: dict[int, int] = {}

    def check(case) -> None:
        if isinstance(case.body, dict):  # keep generation short: the point is the input
            for key in ("max_tokens", "max_completion_tokens"):
                if isinstance(case.body.get(key), int) and case.body[key] > 16:
                    case.body[key] = 16
        r = case.call(base_url=s.url, timeout=30)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        problem = None
        if r.status_code >= 500:
            problem = "server error"
        elif r.status_code >= 400:
            try:
                err = r.json()["error"]
                if set(err) != {"message", "type", "param", "code"} or err["code"] != r.status_code:
                    problem = "not an OpenAI error body"
            except (ValueError, KeyError, TypeError):
                problem = "not an OpenAI error body"
        assert problem is None, f"{problem}: {r.status_code} for {case.body!r:.300} -> {r.text:.300}"

    modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE] if has_input else [GenerationMode.POSITIVE]
    for mode in modes:
        # the same ~50 examples per mode on every run (derandomize), no shrinking: a failure
        # names its request and fails at once
        settings(max_examples=50, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
                 suppress_health_check=list(HealthCheck))(given(operation.as_strategy(generation_mode=mode))(check))()
    assert httpx.get(s.url + "/health").status_code == 200  # nothing took the engine down
    print(f"\n[figures] fuzz {method} {path}: {sum(seen.values())} requests, statuses {dict(sorted(seen.items()))}")


def test_engine_sigkill_mid_stream_errors_streams_then_503_then_clean_sigterm(servers):
    with servers.take("small") as s:
        (pid,) = s.engine_pids()

        async def run() -> tuple[list[dict | None], float, float]:
            async with httpx.AsyncClient(timeout=30) as h:
                # 2 run, 4 wait; each holds its stream open
                streams = [h.stream("POST", s.url + "/v1/completions", json=body(PROMPTS[i], 100, stream=True))
                           for i in range(6)]
                responses = [await st.__aenter__() for st in streams]
                lines = [r.aiter_lines() for r in responses]
                assert (await asyncio.wait_for(anext(lines[0]), 30)).startswith("data: {")  # it is running
                t_kill = time.monotonic()
                os.kill(pid, signal.SIGKILL)

                async def last_event(it) -> dict | None:
                    err = None
                    async for line in it:
                        err = error_event(line) or err
                    return err

                errs = await asyncio.wait_for(asyncio.gather(*(last_event(it) for it in lines)), 15)
                t_errors = time.monotonic() - t_kill
                for st in streams:
                    await st.__aexit__(None, None, None)
                while (await h.get(s.url + "/health")).status_code != 503:
                    assert time.monotonic() - t_kill < 5, "/health still 200 5 s after the engine died"
                    await asyncio.sleep(0.05)
                return errs, t_errors, time.monotonic() - t_kill

        errs, t_errors, t_503 = asyncio.run(run())
        err = assert_openai_error(httpx.post(s.url + "/v1/completions", json=body("hi", 4)), 503)
        t0 = time.monotonic()
        code = s.stop()
        t_exit = time.monotonic() - t0
        print(f"\n[figures] engine SIGKILL: 6 streams, errored {sum(e is not None for e in errs)}, error events "
              f"{t_errors:.2f} s, /health 503 {t_503:.2f} s after the kill; SIGTERM exit {code} in {t_exit:.1f} s")
        assert all(e is not None and e["code"] == 500 and e["message"] for e in errs), errs
        assert err["type"] == "ServiceUnavailableError"
        assert code == 0


def test_api_server_sigkill_takes_its_busy_engines_down(servers):
    with servers.take("pool4") as s:
        pids = s.engine_pids()
        assert pids and all(pid_alive(p) for p in pids)

        async def run() -> None:
            async with httpx.AsyncClient(timeout=30) as h:
                # far more work than the engine can finish in the 10 s allowed
                streams = [h.stream("POST", s.url + "/v1/completions", json=body(PROMPTS[i % 8], 900, stream=True))
                           for i in range(16)]
                responses = [await st.__aenter__() for st in streams]
                first = responses[0].aiter_lines()
                for _ in range(10):
                    await asyncio.wait_for(anext(first), 30)
                s.proc.send_signal(signal.SIGKILL)
                s.proc.wait(10)
                for st in streams:
                    try:
                        await st.__aexit__(None, None, None)
                    except httpx.HTTPError:
                        pass

        try:
            asyncio.run(run())
            t0 = time.monotonic()
            while any(pid_alive(p) for p in pids) and time.monotonic() - t0 < 10:
                time.sleep(0.1)
            t_gone = time.monotonic() - t0
            alive = [p for p in pids if pid_alive(p)]
            print(f"\n[figures] API server SIGKILL: 16 streams, engines {'gone' if not alive else 'ALIVE'} "
                  f"{t_gone:.1f} s after")
            assert not alive, f"engine processes {alive} outlived their API server by 10 s"
        finally:
            for p in pids:  # never leave an orphan engine behind a failed test
                if pid_alive(p):
                    os.kill(p, signal.SIGKILL)

"""`lane serve` with two data-parallel replicas and an API key; an engine that dies;
SIGTERM."""
import asyncio
import glob
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import httpx2 as httpx
import openai
import pytest

from lane import SamplingParams
from conftest import PROMPTS
from utils import RemoteServer, metric

ARGS = ["--dtype", "float32", "--quantization", "none", "--kv-cache-memory-bytes", "128M", "--max-model-len", "1024"]  # as lane_smollm_fp32


def test_data_parallel_spreads_requests_and_keeps_outputs(lane_smollm_fp32):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} [{i}]" for i in range(12)]
    want = [o.outputs[0].text for o in lane_smollm_fp32.generate(
        prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)]
    with RemoteServer([*ARGS, "--data-parallel-size", "2", "--api-key", "sekrit"], api_key="sekrit") as s:
        assert len(s.engine_pids()) == 2
        # the key is required on /v1 (401 with an OpenAI-style body), not on /health
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        assert httpx.get(s.url + "/health").status_code == 200

        async def one(prompt):
            async with httpx.AsyncClient(timeout=120) as h:
                r = await h.post(s.url + "/v1/completions", headers={"Authorization": "Bearer sekrit"},
                                 json={"prompt": prompt, "max_tokens": 12, "temperature": 0})
                return r.headers["x-data-parallel-rank"], r.json()["choices"][0]["text"]

        async def run():
            return await asyncio.gather(*(one(p) for p in prompts))

        results = asyncio.run(run())
        assert [text for _, text in results] == want
        ranks = [rank for rank, _ in results]
        assert ranks.count("0") >= 3 and ranks.count("1") >= 3, ranks
        text = httpx.get(s.url + "/metrics").text
        assert metric(text, "vllm:prompt_tokens_total", engine="0") > 0
        assert metric(text, "vllm:prompt_tokens_total", engine="1") > 0
        # a pinned request goes where it is told
        c = s.client()
        pinned = c.completions.with_raw_response.create(model=c.models.list().data[0].id, prompt="Hello",
                                                        max_tokens=2, extra_body={"data_parallel_rank": 1})
        assert pinned.headers["x-data-parallel-rank"] == "1"
        r = httpx.post(s.url + "/v1/completions", headers={"Authorization": "Bearer sekrit"},
                       json={"prompt": "hi", "data_parallel_rank": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "data_parallel_rank"
        # structured outputs on either replica (each compiles its own grammars), n = 2
        for rank in (0, 1):
            r = c.completions.with_raw_response.create(
                model=c.models.list().data[0].id, prompt="The war ended in the year", max_tokens=8, n=2,
                temperature=1.0, seed=rank, extra_body={"data_parallel_rank": rank, "guided_regex": r" 1[5-9]\d\d"})
            assert r.headers["x-data-parallel-rank"] == str(rank)
            texts = [ch.text for ch in r.parse().choices]
            assert len(texts) == 2 and all(re.fullmatch(r" 1[5-9]\d\d", t) for t in texts), texts


def test_engine_death_fails_requests_and_health_then_sigterm_is_clean():
    with RemoteServer(ARGS) as s:
        (pid,) = s.engine_pids()
        c = s.client(timeout=30)
        model = c.models.list().data[0].id
        stream = c.completions.create(model=model, prompt="Once upon a time", max_tokens=900,
                                      extra_body={"ignore_eos": True}, stream=True)
        next(iter(stream))  # the request is running
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(openai.APIError, match="died"):
            for _ in stream:
                pass
        assert time.monotonic() - t0 < 10
        deadline = time.monotonic() + 10
        while httpx.get(s.url + "/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        # new work is refused at once, not left hanging
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model=model, prompt="hi", max_tokens=2)
        assert e.value.status_code == 503
        t0 = time.monotonic()
        assert s.stop() == 0
        assert time.monotonic() - t0 < 15


def test_sigterm_stops_server_and_engines():
    with RemoteServer(ARGS) as s:
        pids = s.engine_pids()
        assert s.stop() == 0
        for pid in pids:
            deadline = time.monotonic() + 5
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not _alive(pid)


def test_runtime_error_while_serving_fails_requests_and_health():
    """An engine that fails mid-run (a fault injected at its 60th step): the log says runtime
    error, with the traceback, not "cannot start"; a request in flight gets a 500 body, a
    stream an error event; /health turns 503."""
    import threading

    with RemoteServer(ARGS, env={"LANE_FAULT_INJECT": "step:60"}) as s:
        body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}
        plain: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: plain.append(
            httpx.post(s.url + "/v1/completions", json=body, timeout=60)))
        waiter.start()
        deadline = time.monotonic() + 30
        while _num_running(s) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        events = []
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        waiter.join(60)
        assert plain[0].status_code == 500
        err = plain[0].json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == 500
        assert err["type"] == "InternalServerError" and "Traceback" not in err["message"]
        # the engine's own error, not only that it died with exit code 1
        assert "ValueError: fault injected at step 60" in err["message"], err
        assert events[-1] == "data: [DONE]" and '"text"' in events[0]  # some text came, then the error
        assert json.loads(events[-2][6:])["error"]["code"] == 500
        assert "fault injected at step 60" in json.loads(events[-2][6:])["error"]["message"]
        deadline = time.monotonic() + 10
        while httpx.get(s.url + "/health", timeout=30).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        log = s.read_log()
        assert "runtime error" in log and "fault injected at step 60" in log
        assert "Traceback" in log and "cannot start" not in log


def test_engine_not_taking_requests_gives_503_and_aborts_the_prompts_sent():
    """An engine whose input queue is full (stopped with SIGSTOP here, so ZeroMQ's high-water
    mark fills and a send fails with zmq.Again): a completion of many prompts gets an
    OpenAI-style 503, and its prompts already sent are aborted, not computed for nobody.
    The waiting-queue bound is raised past the request's 4000 prompts: the queue that
    refuses here is ZeroMQ's, not the balancer's."""
    with RemoteServer([*ARGS, "--max-num-waiting-requests", "10000"]) as s:
        (pid,) = s.engine_pids()
        os.kill(pid, signal.SIGSTOP)
        try:
            r = httpx.post(s.url + "/v1/completions", timeout=60, json={
                "prompt": [[1, 2, 3, 4]] * 4000, "max_tokens": 200, "ignore_eos": True})
        finally:
            os.kill(pid, signal.SIGCONT)
        assert r.status_code == 503, r.text[:300]
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "ServiceUnavailableError" and err["code"] == 503
        # the engine got the prompts sent before the failure, and their aborts: soon it is idle
        # (1000+ requests of 200 tokens would keep it busy for many minutes)
        time.sleep(2)  # it runs again, and has reported what it holds
        deadline = time.monotonic() + 30
        while True:
            text = httpx.get(s.url + "/metrics", timeout=30).text
            reported = "vllm:num_requests_waiting{" in text  # the engine's stats have arrived
            busy = metric(text, "vllm:num_requests_running") + metric(text, "vllm:num_requests_waiting") \
                if reported else None
            if busy == 0:
                break
            assert time.monotonic() < deadline, f"{busy} requests still in the engine"
            time.sleep(0.5)
        generated = metric(text, "vllm:generation_tokens_total")
        time.sleep(2)
        assert metric(httpx.get(s.url + "/metrics", timeout=30).text, "vllm:generation_tokens_total") == generated
        # and it serves again
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and httpx.get(s.url + "/health").status_code == 200


def test_start_up_error_says_cannot_start():
    with pytest.raises(RuntimeError) as e:  # a KV budget too small for one request of max_model_len
        RemoteServer(["--dtype", "float32", "--kv-cache-memory-bytes", "1M", "--max-model-len", "1024"])
    assert "Engine core 0 cannot start: KV cache budget" in str(e.value)
    assert "runtime error" not in str(e.value)


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_engine_exits_when_the_api_server_is_killed(busy):
    """An API server that dies without a word (SIGKILL, OOM) must not leave its engine
    holding the model and the KV pool: the engine exits within 10 s, idle or mid-stream."""
    with RemoteServer(ARGS) as s:
        (pid,) = s.engine_pids()
        if busy:
            c = s.client(timeout=30)
            stream = c.completions.create(model=c.models.list().data[0].id, prompt="Once upon a time",
                                          max_tokens=900, extra_body={"ignore_eos": True}, stream=True)
            next(iter(stream))  # the engine is generating, and sending outputs
        s.proc.kill()
        s.proc.wait(5)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        orphaned = _alive(pid)
        if orphaned:
            os.kill(pid, signal.SIGKILL)  # leave no engine behind, whatever the outcome
        assert not orphaned, "the engine outlived its API server by 10 s"
        assert f"API server (pid {s.proc.pid}) is gone; engine core 0 exits" in s.read_log()
    # its IPC dir stayed behind (nobody could remove it); the next start removes it
    left = glob.glob(os.path.join(tempfile.gettempdir(), f"lane-ipc-{s.proc.pid}-*"))
    assert len(left) == 1
    subprocess.run([sys.executable, "-c", "import shutil; from lane.ipc_paths import make_ipc_dir; "
                    "shutil.rmtree(make_ipc_dir('ipc'))"], check=True, timeout=60)
    assert not os.path.exists(left[0])


def _num_running(s: RemoteServer) -> float:
    text = httpx.get(s.url + "/metrics", timeout=30).text
    # the gauge has no sample until the engine's first stats arrive
    return metric(text, "vllm:num_requests_running") if "vllm:num_requests_running{" in text else 0.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it has exited all the same
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"

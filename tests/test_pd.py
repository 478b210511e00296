"""Prefill/decode disaggregation (seed step 55): two engines joined by a KV connector give one
engine's greedy tokens, the decode side computing only what the connector could not bring,
for every KV cache kind lane has (paged K/V, MLA latents, V3.2's indexer keys, V4's compressed
entries, block-edge snapshots and sliding window)."""
import json

import pytest

from lane import LLM, SamplingParams
from lane.entrypoints.tiny_model import write_tiny_model
from lane.tracing import Step, tracer

ARCHS = ("qwen3", "deepseek_v3", "deepseek_v32", "deepseek_v4")
# prompts of 5 to 300 tokens; the prefill side chunks them at 64 tokens a step
PROMPTS = [list(range(1000 + 7 * n, 1000 + 8 * n)) for n in (5, 16, 17, 40, 100, 300)]
KW = dict(dtype="float32", show_progress=False, max_model_len=512, kv_cache_memory_bytes=8 << 20)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-pd")
    return {arch: write_tiny_model(arch, str(root / arch)) for arch in ARCHS}


def _kv(role: str, path) -> dict:
    return {"kv_connector": "ExampleConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(path)}}


@pytest.mark.parametrize("arch,kv_cache_dtype", [(a, "auto") for a in ARCHS] + [
    ("qwen3", "int8"), ("deepseek_v32", "int8"), ("deepseek_v4", "fp8_e4m3")])
def test_example_connector_decode_equals_one_engine(tiny, tmp_path, arch, kv_cache_dtype):
    """The prefill engine computes each prompt (chunked) and stores its whole blocks before the
    last token; the decode engine loads them and computes (n - 1) % block_size + 1 prompt tokens
    of each, no more; its greedy tokens equal one engine's. Step 55 is traced on both sides. The
    8-bit caches (C8) move with their scales."""
    KW = dict(globals()["KW"], kv_cache_dtype=kv_cache_dtype)
    ref = LLM(tiny[arch], max_num_batched_tokens=64, **KW)
    want = [o.outputs[0].token_ids for o in ref.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                          use_tqdm=False)]
    ref.shutdown()
    tracer.enable()
    try:
        prefill = LLM(tiny[arch], max_num_batched_tokens=64, kv_transfer_config=_kv("kv_producer", tmp_path), **KW)
        prefill.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=1),
                         use_tqdm=False)
        saves = [s for s in tracer.drain() if s.step == Step.KV_TRANSFER]
        prefill.shutdown()
        bs = 16
        assert len(saves) == sum(len(p) > bs for p in PROMPTS)
        assert all(s.attrs["direction"] == "save" and s.attrs["bytes"] > 0 for s in saves)
        decode = LLM(tiny[arch], kv_transfer_config=_kv("kv_consumer", tmp_path), **KW)
        sched = decode.engine.scheduler
        for p, w in zip(PROMPTS, want):
            before = sched.num_prompt_tokens_computed
            out = decode.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0]
            assert out.outputs[0].token_ids == w, len(p)
            computed = sched.num_prompt_tokens_computed - before
            assert computed == (len(p) if len(p) <= bs else (len(p) - 1) % bs + 1), (len(p), computed)
        loads = [s for s in tracer.drain() if s.step == Step.KV_TRANSFER]
        assert len(loads) == len(saves) and all(s.attrs["direction"] == "load" for s in loads)
        stats = decode.engine.make_stats()
        assert stats.kv_transfer.bytes == sum(s.attrs["bytes"] for s in loads) > 0
        assert stats.prompt_tokens_computed == sum(len(p) if len(p) <= bs else (len(p) - 1) % bs + 1
                                                   for p in PROMPTS)
        decode.shutdown()
    finally:
        tracer.enabled, tracer.rank = False, None
        tracer.drain()


def test_an_engine_with_another_cache_layout_is_refused_by_name(tiny, tmp_path):
    first = LLM(tiny["qwen3"], kv_transfer_config=_kv("kv_producer", tmp_path), **KW)
    first.shutdown()
    with pytest.raises(ValueError, match=r"--kv-transfer-config: the KV under .* was written by an engine whose "
                                         r"cache differs from this one's in block_size"):
        LLM(tiny["qwen3"], block_size=32, kv_transfer_config=_kv("kv_consumer", tmp_path), **KW)
    with pytest.raises(ValueError, match="cache differs from this one's in"):  # an 8-bit cache (C8) is another
        LLM(tiny["qwen3"], kv_cache_dtype="int8", kv_transfer_config=_kv("kv_consumer", tmp_path), **KW)


@pytest.mark.parametrize("value,needle", [
    ('{"kv_connector": "Nope"}', "kv_connector 'Nope' is not one of"),
    ('{"kv_connector": "ExampleConnector", "kv_role": "both"}', "kv_role 'both' is not one of"),
    ('{"kv_connector": "ExampleConnector", "kv_port": 0}', "kv_port must be an integer >= 1"),
    ('{"kv_connector": "ExampleConnector", "kv_ports": 1}', "unknown key(s) kv_ports"),
    ('{"kv_role": "kv_both"}', 'must be an object with a "kv_connector"'),
    ("{oops", "--kv-transfer-config is not JSON"),
    ('{"kv_connector": "ExampleConnector"}', "ExampleConnector needs kv_connector_extra_config"),
])
def test_bad_kv_transfer_configs_are_refused_by_name(tiny, value, needle):
    with pytest.raises(ValueError, match=None) as e:
        LLM(tiny["qwen3"], kv_transfer_config=value, **KW)
    assert needle in str(e.value)


# -- the TCP pull connector ------------------------------------------------------------------

SECRET = "a-pd-test-secret-0123456789"


class Pump:
    """Steps an engine in a thread (the prefill engine's own loop, as its process would run it):
    its side channel learns what to serve, and frees what was pulled or expired."""

    def __init__(self, llm: LLM) -> None:
        import threading

        self.llm, self.stop = llm, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.llm.engine.has_unfinished_requests():
                self.llm.engine.step()
            else:
                self.stop.wait(0.001)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def _tcp(role: str, port: int, **extra) -> dict:
    return {"kv_connector": "TcpConnector", "kv_role": role, "kv_port": port, "kv_connector_extra_config": extra}


def _prefill(llm: LLM, prompt: list[int]) -> dict:
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(
        temperature=0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}}), use_tqdm=False)[0]
    return out.kv_transfer_params


def _decode(llm: LLM, prompt: list[int], params: dict) -> list[int]:
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, extra_args={"kv_transfer_params": params})
    return llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].token_ids


@pytest.fixture
def secret(monkeypatch):
    monkeypatch.setenv("LANE_RPC_SECRET", SECRET)


@pytest.mark.parametrize("arch,decode_tp", [("qwen3", 1), ("deepseek_v3", 1), ("deepseek_v32", 1), ("deepseek_v4", 1),
                                            ("qwen3", 2), ("deepseek_v3", 2)])
def test_tcp_connector_pulls_all_but_the_last_token(tiny, secret, arch, decode_tp):
    """The decode engine pulls every prompt token's KV but the last (V4: its running state as it
    was before that token, too) and computes exactly one; greedy tokens equal one engine's, with
    a decode side of 2 tensor-parallel ranks under a prefill side of 1 (Qwen3's KV heads re-split,
    V3's latents replicated). The prefill engine frees each request's blocks once pulled."""
    from utils import free_port

    ref = LLM(tiny[arch], max_num_batched_tokens=64, **KW)
    prompts = PROMPTS + [list(range(3000, 3065))]  # 65 tokens: its last prefill chunk is 1 token
    want = [o.outputs[0].token_ids for o in ref.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                                                          use_tqdm=False)]
    ref.shutdown()
    port = free_port()
    prefill = LLM(tiny[arch], max_num_batched_tokens=64, kv_transfer_config=_tcp("kv_producer", port), **KW)
    decode = LLM(tiny[arch], tensor_parallel_size=decode_tp, kv_transfer_config=_tcp("kv_consumer", free_port()),
                 **dict(KW, kv_cache_memory_bytes=decode_tp * KW["kv_cache_memory_bytes"]))
    pump = None
    try:
        sched = decode.engine.scheduler
        for p, w in zip(prompts, want):
            params = _prefill(prefill, p)
            assert params["do_remote_prefill"] and params["remote_port"] == port
            assert len(params["remote_block_ids"]) == len(prefill.engine.kv_cache_config.groups)
            pump = Pump(prefill)
            before = sched.num_prompt_tokens_computed
            assert _decode(decode, p, params) == w, len(p)
            assert sched.num_prompt_tokens_computed - before == 1
            deadline = __import__("time").monotonic() + 10
            while prefill.engine.scheduler.delayed_free:  # the pull's Done frees them
                assert __import__("time").monotonic() < deadline
                __import__("time").sleep(0.01)
            pump.close()
            pump = None
        assert prefill.engine.scheduler.kv.usage == 0
        stats = decode.engine.make_stats().kv_transfer
        assert stats.bytes > 0 and stats.failures == 0
    finally:
        if pump is not None:
            pump.close()
        prefill.shutdown()
        decode.shutdown()


def test_tcp_pulls_are_signed_and_unpulled_blocks_expire(tiny, monkeypatch, caplog):
    """A decode engine with another secret is refused by name in both logs (its request
    recomputes its prompt here, counted as a failure); an unsigned pull gets nothing; blocks
    nobody pulls are freed after abort_timeout_s and counted."""
    import time

    import zmq

    from utils import free_port

    port = free_port()
    monkeypatch.setenv("LANE_RPC_SECRET", SECRET)
    prefill = LLM(tiny["qwen3"], kv_transfer_config=_tcp("kv_producer", port, abort_timeout_s=1.0), **KW)
    monkeypatch.setenv("LANE_RPC_SECRET", "another-secret-0123456789abcdef")
    decode = LLM(tiny["qwen3"], kv_transfer_config=_tcp("kv_consumer", free_port()), **KW)
    ref = LLM(tiny["qwen3"], **KW)
    pump = None
    try:
        p = PROMPTS[3]
        want = ref.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        params = _prefill(prefill, p)
        pump = Pump(prefill)  # from here only the pump steps the prefill engine
        with caplog.at_level("WARNING"):
            sched = decode.engine.scheduler
            before = sched.num_prompt_tokens_computed
            assert _decode(decode, p, params) == want
            assert sched.num_prompt_tokens_computed - before == len(p)  # recomputed
        assert "signs with another secret" in caplog.text  # the decode side's log
        assert "refused" in caplog.text  # the prefill side's
        assert decode.engine.make_stats().kv_transfer.failures == 1
        # an unsigned pull: nothing comes back but the refusal
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.connect(f"tcp://127.0.0.1:{port}")
        s.send(b"\x81\xa4pull" + b"\0" * 40)
        assert s.poll(5000)
        reply = s.recv_multipart()
        assert b"refused" in reply[0] and len(reply) == 1
        s.close(0)
        ctx.term()
        # nobody pulls: the blocks wait abort_timeout_s, then go back to the pool
        deadline = time.monotonic() + 10
        while prefill.engine.scheduler.delayed_free:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert prefill.engine.scheduler.kv.usage == 0
        assert prefill.engine.make_stats().kv_transfer.expired == 1
    finally:
        if pump is not None:
            pump.close()
        for llm in (prefill, decode, ref):
            llm.shutdown()


def test_mtp_with_pd_drafts_as_without(tiny, secret):
    """MTP k = 2 on tiny V4 through the TCP connector: the decode side computes the last prompt
    token again (its hidden state feeds the first draft; its MTP layer's cache came with the
    blocks), so tokens and per-position acceptance equal a single engine's."""
    from utils import free_port

    spec = {"method": "mtp", "num_speculative_tokens": 2}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = PROMPTS[2:5]
    ref = LLM(tiny["deepseek_v4"], speculative_config=spec, **KW)
    want = [ref.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    ref_stats = ref.engine.scheduler.spec_stats
    ref.shutdown()
    prefill = LLM(tiny["deepseek_v4"], speculative_config=spec, kv_transfer_config=_tcp("kv_producer", free_port()), **KW)
    decode = LLM(tiny["deepseek_v4"], speculative_config=spec, kv_transfer_config=_tcp("kv_consumer", free_port()), **KW)
    try:
        for p, w in zip(prompts, want):
            kv = _prefill(prefill, p)
            pump = Pump(prefill)
            try:
                assert _decode_with(decode, p, kv, params) == w
            finally:
                pump.close()
        stats = decode.engine.scheduler.spec_stats
        assert stats.num_drafts == ref_stats.num_drafts > 0
        assert stats.num_accepted_tokens_per_pos == ref_stats.num_accepted_tokens_per_pos
        assert decode.engine.scheduler.num_prompt_tokens_computed == len(prompts)
    finally:
        prefill.shutdown()
        decode.shutdown()


def _decode_with(llm: LLM, prompt: list[int], kv: dict, params: SamplingParams) -> list[int]:
    from dataclasses import replace

    sp = replace(params, extra_args={"kv_transfer_params": kv})
    return llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].token_ids


def test_multi_connector_tries_its_connectors_in_order(tiny, secret, tmp_path):
    """MultiConnector [TCP, shared storage]: a request that comes with the prefill side's
    kv_transfer_params is pulled (one prompt token computed), one that does not finds the prompt
    in shared storage (the block-aligned prefix loaded); both as one engine would answer."""
    from utils import free_port

    def multi(role: str, port: int) -> dict:
        return {"kv_connector": "MultiConnector", "kv_role": role, "kv_connector_extra_config": {"connectors": [
            _tcp(role, port), _kv(role, tmp_path)]}}

    ref = LLM(tiny["deepseek_v3"], **KW)
    p1, p2 = PROMPTS[3], PROMPTS[4]
    want = [ref.generate([{"prompt_token_ids": p}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in (p1, p2)]
    ref.shutdown()
    prefill = LLM(tiny["deepseek_v3"], kv_transfer_config=multi("kv_producer", free_port()), **KW)
    decode = LLM(tiny["deepseek_v3"], kv_transfer_config=multi("kv_consumer", free_port()), **KW)
    try:
        kv = _prefill(prefill, p1)
        prefill.generate([{"prompt_token_ids": p2}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
        pump = Pump(prefill)
        try:
            sched = decode.engine.scheduler
            assert _decode(decode, p1, kv) == want[0]
            assert sched.num_prompt_tokens_computed == 1  # pulled
            out = decode.generate([{"prompt_token_ids": p2}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            assert out == want[1]
            assert sched.num_prompt_tokens_computed == 1 + (len(p2) - 1) % 16 + 1  # from shared storage
        finally:
            pump.close()
    finally:
        prefill.shutdown()
        decode.shutdown()


# -- served: prefill and decode lane serve behind lane proxy ----------------------------------------

def test_proxy_prefill_and_decode_instances_answer_as_one(plain_server, monkeypatch):
    """SmolLM2 (float32, --quantization none) served as a prefill and a decode instance joined by
    the TCP connector, behind lane proxy: the text equals one instance's, streamed and not, for
    completions and chat; both instances' traces join under the proxy's request id (step 55 on
    both); a SIGKILLed prefill instance leaves the proxy's /health naming it, the in-flight
    request fails with an error, and the decode instance stays healthy."""
    import os
    import signal
    import time

    import httpx2 as httpx
    import openai

    from conftest import PLAIN_SERVER_ARGS
    from utils import RemoteServer, free_port, start_proxy

    monkeypatch.setenv("LANE_RPC_SECRET", SECRET)
    common = [*PLAIN_SERVER_ARGS, "--trace"]
    kv_port = free_port()
    with RemoteServer([*common, "--kv-transfer-config",
                       json.dumps(_tcp("kv_producer", kv_port, abort_timeout_s=2.0))]) as p, \
            RemoteServer([*common, "--kv-transfer-config", json.dumps(_tcp("kv_consumer", free_port()))]) as d:
        proxy, url = start_proxy(p.port, d.port)
        try:
            one = plain_server.client()
            via = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60)
            prompt = "The history of computing is long and full of surprises; " * 6
            kw = dict(model="smollm", max_tokens=24, temperature=0)
            want = one.completions.create(prompt=prompt, **kw).choices[0].text
            assert via.completions.create(prompt=prompt, **kw).choices[0].text == want
            streamed = via.completions.create(prompt=prompt, stream=True, **kw)
            assert "".join(c.choices[0].text for c in streamed if c.choices) == want
            messages = [{"role": "user", "content": "Name three colors of the rainbow."}]
            want_chat = one.chat.completions.create(messages=messages, **kw).choices[0].message.content
            got = via.chat.completions.create(messages=messages, **kw).choices[0].message.content
            assert got == want_chat
            # the decode instance computed one prompt token of each (the prefill instance the rest)
            metrics = httpx.get(d.url + "/metrics").text
            computed = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                           if line.startswith("lane:prompt_tokens_computed_total{"))
            assert computed == 3
            # one id on both legs: one trace with step 55 from both instances
            r = httpx.post(url + "/v1/completions", json={**kw, "prompt": prompt}, headers={"X-Request-Id": "pd-1"})
            assert r.status_code == 200 and r.headers["x-request-id"] == "pd-1"
            trace = httpx.get(url + "/v1/traces/cmpl-pd-1").json()
            moved = [s for s in trace["spans"] if s["step"] == 55 and not s.get("skipped")]
            assert {(s["attrs"]["instance"].split()[0], s["attrs"]["direction"]) for s in moved} == {
                ("prefill", "serve"), ("decode", "pull")}
            assert {s["attrs"]["instance"].split()[0] for s in trace["spans"]} == {"prefill", "decode", "proxy"}
            routed = [s for s in trace["spans"] if s["step"] == 13 and s["attrs"]["instance"] == "proxy"]
            assert len(routed) == 1 and routed[0]["attrs"]["decode"] == d.url
            # a client gone between the legs: the prefill instance's kept blocks expire; one gone during
            # the decode leg: the decode instance aborts; nothing stays held on either side
            r = httpx.post(p.url + "/v1/completions", json={**kw, "prompt": prompt, "max_tokens": 1,
                                                            "kv_transfer_params": {"do_remote_decode": True}})
            assert r.json()["kv_transfer_params"]["do_remote_prefill"] is True
            with httpx.stream("POST", url + "/v1/completions", json={**kw, "prompt": prompt * 2, "max_tokens": 400,
                                                                    "stream": True, "ignore_eos": True}) as s:
                next(s.iter_lines())
            deadline = time.monotonic() + 10
            while any(_metric(httpx.get(i.url + "/metrics").text, "vllm:kv_cache_usage_perc") for i in (p, d)):
                assert time.monotonic() < deadline, "blocks stayed held after the clients left"
                time.sleep(0.2)
            assert _metric(httpx.get(p.url + "/metrics").text, "lane:kv_transfer_expired_requests_total") == 1
            # the prefill instance dies: requests fail with an error, the proxy's health names it
            os.kill(p.proc.pid, signal.SIGKILL)
            for child in p.engine_pids():
                try:
                    os.kill(child, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            with pytest.raises(openai.APIError):
                via.completions.create(prompt=prompt, **kw)
            deadline = time.monotonic() + 5
            while True:
                h = httpx.get(url + "/health")
                if h.status_code == 503:
                    break
                assert time.monotonic() < deadline
                time.sleep(0.2)
            lost = [i for i in h.json()["instances"] if not i["healthy"]]
            assert [i["role"] for i in lost] == ["prefill"] and str(p.port) in lost[0]["url"]
            assert httpx.get(d.url + "/health").status_code == 200
        finally:
            proxy.terminate()
            proxy.wait(10)


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.parametrize("params,needle", [
    ({"do_remote_prefill": True}, "remote_block_ids must be a list of lists"),
    ({"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_host": "h", "remote_request_id": "r",
      "remote_port": 99999}, "remote_port must be a port number"),
    ({"do_remote_decode": "yes"}, "do_remote_decode must be true or false"),
])
def test_bad_kv_transfer_params_are_a_400(plain_server, params, needle):
    import httpx2 as httpx

    r = httpx.post(plain_server.url + "/v1/completions",
                   json={"model": "smollm", "prompt": "hi", "max_tokens": 2, "kv_transfer_params": params})
    assert r.status_code == 400
    err = r.json()["error"]
    assert needle in err["message"] and err["param"] == "kv_transfer_params"
    bad_id = httpx.post(plain_server.url + "/v1/completions", json={"model": "smollm", "prompt": "hi", "max_tokens": 2},
                        headers={"X-Request-Id": "no spaces allowed"})
    assert bad_id.status_code == 400 and bad_id.json()["error"]["param"] == "X-Request-Id"


def test_connector_only_steps_are_no_eplb_steps(tiny, secret):
    """A prefill engine waiting for pulls steps its connector alone (no forward): EPLB counts only
    steps with a forward, so replicas in lock-step (-dp with shared experts, one running such a
    step and a dummy batch) keep one count and meet in the same collectives."""
    from utils import free_port

    llm = LLM(tiny["deepseek_v3"], kv_transfer_config=_tcp("kv_producer", free_port(), abort_timeout_s=30.0),
              enable_expert_parallel=True, enable_eplb=True, eplb_config={"step_interval": 1000}, **KW)
    try:
        _prefill(llm, PROMPTS[3])  # its blocks now wait for a pull
        eplb, engine = llm.engine.worker.eplb, llm.engine
        steps = eplb.steps
        for _ in range(5):
            assert engine.has_unfinished_requests() and not engine.scheduler.has_unfinished()
            engine.step()
        assert eplb.steps == steps
    finally:
        llm.shutdown()

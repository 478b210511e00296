"""Prefill/decode disaggregation (seed step 55): two engines joined by a KV connector give one
engine's greedy tokens, the decode side computing only what the connector could not bring,
for every KV cache kind lane has (paged K/V, MLA latents, V3.2's indexer keys, V4's compressed
entries, block-edge snapshots and sliding window)."""
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


@pytest.mark.parametrize("arch", ARCHS)
def test_example_connector_decode_equals_one_engine(tiny, tmp_path, arch):
    """The prefill engine computes each prompt (chunked) and stores its whole blocks before the
    last token; the decode engine loads them and computes (n - 1) % block_size + 1 prompt tokens
    of each, no more; its greedy tokens equal one engine's. Step 55 is traced on both sides."""
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

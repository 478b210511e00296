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

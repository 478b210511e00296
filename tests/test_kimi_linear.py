"""Kimi Linear on a tiny random checkpoint (KDA, KDA, MLA without rope, KDA; MoE): logits and
greedy tokens against transformers, with chunked prefill continuing each request's delta-rule
and convolution state across chunks, decode rows in the recurrent form, a batch, a preemption
(the state recomputed from the prompt) and no prefix-cache hits (the state is not snapshotted)."""
import pytest
import torch

from lane import LLM, SamplingParams
from lane.entrypoints.explain import explain
from lane.entrypoints.tiny_model import write_tiny_model
from conftest import assert_greedy_equals_hf, assert_logprobs_match_hf
from test_deepseek import _prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_model("kimi_linear", str(tmp_path_factory.mktemp("kimi") / "m"))


@pytest.fixture(scope="module")
def hf(tiny):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()


def test_logits_match_transformers(tiny, hf):
    """Prompts of 5 and 70 tokens: one and two 64-row chunks of the chunked form, then decode
    rows; KimiK3ForCausalLM, the seed's alias, resolves to the same class."""
    from lane import ModelRegistry

    assert ModelRegistry.resolve_model_cls("KimiK3ForCausalLM")[0] is ModelRegistry.resolve_model_cls(
        "KimiLinearForCausalLM")[0]
    llm = LLM(tiny, dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256, show_progress=False)
    try:
        assert_logprobs_match_hf(llm, hf, _prompts((5, 70)), 8, "kimi_linear")
    finally:
        llm.shutdown()


def test_engine_greedy_equals_transformers(tiny, hf):
    """8-token chunks (each continuing its request's state), a batch of mixed lengths, a pool small
    enough to preempt, and the same prompts again: no prefix-cache hit (none could rebuild the
    state), the same tokens. lane explain says why."""
    llm = LLM(tiny, dtype="float32", kv_cache_memory_bytes=20 << 10, block_size=16, max_num_batched_tokens=8,
              max_num_seqs=4, max_model_len=96, show_progress=False)
    try:
        prompts = _prompts((7, 33, 40), seed=3)
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        again = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        sched = llm.engine.scheduler
        assert sched.num_preemptions > 0 and sched.kv.stats.hits == 0
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
        for ids, out in zip(prompts, outs):
            assert assert_greedy_equals_hf(hf, ids, out.outputs[0].token_ids, 16, len(ids)) == 16
    finally:
        llm.shutdown()
    text = explain(tiny)
    assert "KimiLinearForCausalLM" in text and "not snapshotted" in text


def test_speculation_and_pd_refused_by_name(tiny, tmp_path):
    with pytest.raises(ValueError, match="delta-rule state cannot step back"):
        LLM(tiny, dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 2},
            kv_cache_memory_bytes=16 << 20, max_model_len=256, show_progress=False)
    with pytest.raises(ValueError, match="--kv-transfer-config: KimiLinearForCausalLM's delta-rule state cannot be"):
        LLM(tiny, dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=256, show_progress=False,
            kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}})

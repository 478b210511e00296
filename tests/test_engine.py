"""Scheduler, KV cache and prefix cache: none of them may change greedy output."""
import pytest

from lane import LLM, SamplingParams
from conftest import PROMPTS

GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
SHARED = ("You are a meticulous assistant. Answer every question with care, cite the facts you "
          "use, and keep the answer short. Question: ")
SHARED_PROMPTS = [SHARED + q for q in ("Why is the sky blue?", "What is a prime number?",
                                        "How do bees make honey?", "What is rust on iron?")]


def _texts(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def baseline(lane_smollm_fp32):
    return _texts(lane_smollm_fp32.generate(PROMPTS + SHARED_PROMPTS, GREEDY, use_tqdm=False))


def _llm(gguf, **kw):
    kw.setdefault("kv_cache_memory_bytes", 256 << 20)
    kw.setdefault("max_model_len", 1024)
    kw.setdefault("quantization", "none")  # the float32 path, where batching never changes greedy output
    return LLM(gguf, dtype="float32", show_progress=False, **kw)


def test_prefix_caching_off_same_output(smollm_gguf, baseline):
    llm = _llm(smollm_gguf, enable_prefix_caching=False)
    assert _texts(llm.generate(PROMPTS + SHARED_PROMPTS, GREEDY, use_tqdm=False)) == baseline
    assert llm.prefix_cache_stats.hits == 0


def test_small_chunks_same_output(smollm_gguf, baseline):
    """Budget of 32 tokens per step: every prompt is cut into chunks that share
    steps with other requests' decodes."""
    llm = _llm(smollm_gguf, max_num_batched_tokens=32)
    assert _texts(llm.generate(PROMPTS + SHARED_PROMPTS, GREEDY, use_tqdm=False)) == baseline


def test_budget_below_num_seqs(smollm_gguf, baseline):
    llm = _llm(smollm_gguf, max_num_batched_tokens=3, max_num_seqs=8)
    assert _texts(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)) == baseline[:2]


def test_preemption_same_output(smollm_gguf, baseline):
    """A pool too small for the whole batch: requests are preempted, recomputed,
    and all finish with the same tokens."""
    # fp32 SmolLM2: 737,280 B per 16-token block; 24 blocks for 8 requests of ~70-110 tokens
    llm = _llm(smollm_gguf, kv_cache_memory_bytes=25 * 737280, max_model_len=256)
    outs = llm.generate(PROMPTS + SHARED_PROMPTS, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert all(o.finished for o in outs)
    assert _texts(outs) == baseline


def test_prefix_cache_hits_on_second_run(smollm_gguf, baseline):
    llm = _llm(smollm_gguf)
    lens = [len(llm.get_tokenizer().encode(p)) for p in SHARED_PROMPTS]
    first = _texts(llm.generate(SHARED_PROMPTS, GREEDY, use_tqdm=False))
    stats = llm.prefix_cache_stats
    # one step admits all four: nothing is cached yet when they are looked up
    assert (stats.queries, stats.hits) == (sum(lens), 0)
    second = _texts(llm.generate(SHARED_PROMPTS, GREEDY, use_tqdm=False))
    # every full block of each prompt is found, except that the last prompt token is recomputed
    assert stats.queries == 2 * sum(lens)
    assert stats.hits == sum((n - 1) // 16 * 16 for n in lens) > 0
    assert first == second == baseline[len(PROMPTS):]
    # every block is free again (cached blocks that nobody references count as free)
    kv = llm.engine.scheduler.kv
    assert kv.pool.num_free_blocks == kv.pool.num_blocks


def test_chat_and_stop_conditions(lane_smollm_fp32):
    llm = lane_smollm_fp32
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # EOS (<|im_end|>) ended it
    # stop string: cut before it, never in the text
    base = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=30),
                        use_tqdm=False)[0].outputs[0]
    assert "Nova Haven" in base.text
    cut = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=30, stop="Haven"),
                       use_tqdm=False)[0].outputs[0]
    assert cut.text == base.text[:base.text.index("Haven")]
    assert cut.finish_reason == "stop" and cut.stop_reason == "Haven"
    # stop token id
    tid = base.token_ids[3]
    st = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=30,
                                                        stop_token_ids=[tid]), use_tqdm=False)[0].outputs[0]
    assert st.token_ids == base.token_ids[:4] and st.stop_reason == tid
    # max_tokens
    assert len(base.token_ids) == 30 and base.finish_reason == "length"


def test_model_length_limit(smollm_gguf):
    llm = _llm(smollm_gguf, max_model_len=40)
    tok = llm.get_tokenizer()
    ids = tok.encode(PROMPTS[3])[:30]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=100,
                                                                ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match=r"41 tokens.*maximum model length of 40"):
        llm.generate({"prompt_token_ids": tok.encode(PROMPTS[3])[:41]}, use_tqdm=False)
    # the failed request left nothing behind
    assert not llm.engine.has_unfinished_requests()


def test_one_bad_prompt_in_a_batch_queues_nothing(lane_smollm_fp32):
    """Every prompt is validated before any is added: a bad one leaves no request behind
    for a later call to compute and never return."""
    llm = lane_smollm_fp32
    too_long = {"prompt_token_ids": [1] * (llm.config.model_config.max_model_len + 1)}
    with pytest.raises(ValueError, match="maximum model length"):
        llm.generate(["Once upon a time", "The sea", too_long], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert not llm.output_processor.has_unfinished()
    with pytest.raises(TypeError):
        llm.generate(["Once upon a time", 42], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and not llm.output_processor.has_unfinished()

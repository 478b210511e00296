"""Sampler behaviour through the whole engine, and the errors users get for bad input."""

import pytest
import torch

from lane import LLM, SamplingParams
from lane.model_executor.layers.sampler import SamplingMetadata, sample

PROMPT = "My favourite animal is"


def _gen(llm, prompts, **kw):
    return llm.generate(prompts, SamplingParams(**kw), use_tqdm=False)


def test_seed_reproducible_whatever_the_batch(lane_smollm_fp32):
    llm = lane_smollm_fp32
    alone = _gen(llm, PROMPT, temperature=1.0, seed=1234, max_tokens=24)[0].outputs[0].token_ids
    params = [SamplingParams(temperature=1.0, seed=1234, max_tokens=24),
              SamplingParams(temperature=0.8, max_tokens=24), SamplingParams(temperature=0, max_tokens=5)]
    batched = llm.generate([PROMPT, "Hello", "The sea"], params, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == batched
    other = _gen(llm, PROMPT, temperature=1.0, seed=99, max_tokens=24)[0].outputs[0].token_ids
    assert other != alone


def test_n_samples(lane_smollm_fp32):
    out = _gen(lane_smollm_fp32, PROMPT, n=3, temperature=1.0, seed=7, max_tokens=16)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_top_k_1_is_greedy(lane_smollm_fp32):
    greedy = _gen(lane_smollm_fp32, PROMPT, temperature=0, max_tokens=20)[0].outputs[0].token_ids
    topk1 = _gen(lane_smollm_fp32, PROMPT, temperature=1.5, top_k=1, seed=3, max_tokens=20)
    assert topk1[0].outputs[0].token_ids == greedy
    tiny_p = _gen(lane_smollm_fp32, PROMPT, temperature=1.5, top_p=1e-6, seed=3, max_tokens=20)
    assert tiny_p[0].outputs[0].token_ids == greedy


def test_logprobs(lane_smollm_fp32):
    c = _gen(lane_smollm_fp32, PROMPT, temperature=0, max_tokens=6, logprobs=3)[0].outputs[0]
    assert len(c.logprobs) == 6
    total = 0.0
    for tid, entry in zip(c.token_ids, c.logprobs):
        assert entry[tid].rank == 1  # greedy picks the most likely token
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks == [1, 2, 3]
        assert all(lp.logprob <= 0 for lp in entry.values())
        total += entry[tid].logprob
    assert c.cumulative_logprob == pytest.approx(total)


def test_penalties_change_repetition(lane_smollm_fp32):
    prompt = "one two one two one two one two"
    plain = _gen(lane_smollm_fp32, prompt, temperature=0, max_tokens=12, ignore_eos=True)[0].outputs[0]
    pen = _gen(lane_smollm_fp32, prompt, temperature=0, max_tokens=12, ignore_eos=True,
               repetition_penalty=1.8, frequency_penalty=1.0)[0].outputs[0]
    assert pen.token_ids != plain.token_ids
    assert len(set(pen.token_ids)) >= len(set(plain.token_ids))


def test_sampler_unit_min_p_and_penalty_math():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    md = SamplingMetadata(temperature=torch.tensor([1.0]), all_greedy=False,
                          min_p=torch.tensor([0.5]), num_logprobs=[None])
    seen = set(sample(logits, md).token_ids[0] for _ in range(200))
    # p = softmax: [0.64, 0.24, 0.09, 0.03]; min_p 0.5 keeps only tokens with p >= 0.32
    assert seen == {0}
    md = SamplingMetadata(temperature=torch.tensor([0.0]), all_greedy=True, num_logprobs=[None],
                          repetition_penalty=torch.tensor([4.0]), presence_penalty=torch.tensor([0.0]),
                          frequency_penalty=torch.tensor([0.0]), prompt_token_ids=[[0]],
                          output_token_ids=[[]])
    assert sample(logits, md).token_ids == [1]  # 2/4 = 0.5 < 1.0


def test_sampler_draws_from_the_distribution():
    # p = [0.5, 0.3, 0.2, 0] at temperature 1; 40,000 rows, one draw each
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = probs.clamp(min=1e-30).log().expand(40000, 4).clone()
    logits[:, 3] = float("-inf")
    md = SamplingMetadata(temperature=torch.ones(40000), all_greedy=False, num_logprobs=[None] * 40000)
    freq = torch.bincount(torch.tensor(sample(logits, md).token_ids), minlength=4) / 40000
    assert freq[3] == 0
    assert torch.allclose(freq[:3], probs[:3], atol=0.015), freq
    # a seeded row draws the same token whatever the rest of the batch is
    gen = lambda: {0: torch.Generator().manual_seed(5)}  # noqa: E731
    one = sample(logits[:1], SamplingMetadata(torch.ones(1), False, generators=gen(), num_logprobs=[None]))
    many = sample(logits[:64], SamplingMetadata(torch.ones(64), False, generators=gen(), num_logprobs=[None] * 64))
    assert one.token_ids[0] == many.token_ids[0]


@pytest.mark.parametrize("kw, field", [
    (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-3), "top_k"), (dict(n=0), "n"), (dict(max_tokens=0), "max_tokens"),
    (dict(logprobs=21), "logprobs"), (dict(min_p=2.0), "min_p"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(seed=2**64), "seed"),  # torch's generators take 64-bit seeds: the engine would crash on it
])
def test_invalid_sampling_params(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_top_k_minus_one_disables():
    assert SamplingParams(top_k=-1).top_k == 0


def test_missing_model_path():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM("/no/such/model", show_progress=False)


def test_unknown_architecture(tmp_path, smollm_tokenizer):
    import json
    from conftest import make_tiny_checkpoint

    d = make_tiny_checkpoint("llama", tmp_path / "m", smollm_tokenizer)
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["FooBarForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"FooBarForCausalLM.*not supported.*LlamaForCausalLM"):
        LLM(d, dtype="float32", kv_cache_memory_bytes=16 << 20, show_progress=False)


def test_min_tokens_masks_eos_and_stop_tokens_and_delays_stop_strings(lane_smollm_fp32):
    """vLLM's min_tokens: EOS and stop_token_ids cannot be sampled before min_tokens
    tokens exist, and stop strings only count after them."""
    llm = lane_smollm_fp32
    eos = llm.get_tokenizer().eos_token_id
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    natural = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    assert natural.token_ids[-1] == eos and len(natural.token_ids) < 20  # greedy ends early, on EOS
    held = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40, min_tokens=20), use_tqdm=False)[0].outputs[0]
    assert eos not in held.token_ids[:20]
    assert held.token_ids[:len(natural.token_ids) - 1] == natural.token_ids[:-1]
    assert len(held.token_ids) >= 20
    # a stop token id: masked, not merely ignored, before min_tokens
    paris = natural.token_ids[5]
    st = llm.chat(chat, SamplingParams(temperature=0, max_tokens=40, min_tokens=8, stop_token_ids=[paris]),
                  use_tqdm=False)[0].outputs[0]
    assert paris not in st.token_ids[:8] and len(st.token_ids) >= 8
    # a stop string inside the first min_tokens tokens does not stop the request
    base = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=30),
                        use_tqdm=False)[0].outputs[0]
    assert "Haven" in llm.get_tokenizer().decode(base.token_ids[:10])
    late = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=30, min_tokens=10, stop="Haven"),
                        use_tqdm=False)[0].outputs[0]
    assert late.text == base.text and late.finish_reason == "length"


def test_stop_token_ids_outside_the_vocabulary_are_refused(lane_smollm_fp32):
    with pytest.raises(ValueError, match="stop_token_ids"):
        lane_smollm_fp32.generate("Hi", SamplingParams(min_tokens=2, stop_token_ids=[10**6]), use_tqdm=False)
    assert not lane_smollm_fp32.engine.has_unfinished_requests()

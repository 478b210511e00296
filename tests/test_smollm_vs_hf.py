"""The embedded default model against HF transformers on the same GGUF."""

import pytest

from lane import LLM, SamplingParams
from conftest import PROMPTS, hf_greedy


@pytest.fixture(scope="module")
def hf_refs(hf_smollm, smollm_tokenizer):
    """HF transformers' fp32 greedy 64 tokens for each prompt (computed once for both tests)."""
    return [hf_greedy(hf_smollm, smollm_tokenizer.encode(p), 64) for p in PROMPTS]


def test_tokenizer_matches_hf_on_plain_text(lane_smollm_fp32, smollm_gguf):
    from transformers import AutoTokenizer
    import os

    d, f = os.path.split(smollm_gguf)
    hf_tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    tok = lane_smollm_fp32.get_tokenizer()
    for p in PROMPTS:
        assert tok.encode(p) == hf_tok.encode(p)
    assert tok.encode("Once upon a time") == [6403, 1980, 253, 655]


def test_greedy_batch_matches_hf_fp32(lane_smollm_fp32, hf_refs):
    """Several prompts of different lengths, one batch, 64 tokens each: token-identical."""
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    outs = lane_smollm_fp32.generate(PROMPTS, sp, use_tqdm=False)
    for prompt, out, ref in zip(PROMPTS, outs, hf_refs):
        assert out.outputs[0].token_ids == ref, prompt
        assert out.outputs[0].finish_reason == "length"
    assert outs[0].outputs[0].text.startswith(", the city of Nova Haven was a thriving metropolis")


def test_greedy_bf16_report(smollm_gguf, hf_refs, capsys):
    """bf16 rounding depends on batch shape: report how many tokens agree with HF fp32."""
    llm = LLM(smollm_gguf, dtype="bfloat16", quantization="none", kv_cache_memory_bytes=256 << 20,
              max_model_len=1024, show_progress=False)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                        use_tqdm=False)
    matched = total = 0
    for out, ref in zip(outs, hf_refs):
        got = out.outputs[0].token_ids
        n = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref))
        matched += n
        total += len(ref)
    with capsys.disabled():
        print(f"\nbf16 vs HF fp32: {matched}/{total} tokens equal before the first divergence")
    assert matched >= len(PROMPTS)  # at least the first token of each prompt agrees

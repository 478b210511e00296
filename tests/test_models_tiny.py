"""Tiny random Llama / Qwen2 / Qwen3 / Mistral checkpoints: lane's logits against HF's."""
import pytest
import torch

from lane import LLM
from conftest import assert_logprobs_match_hf, make_tiny_checkpoint

CASES = {
    "llama": dict(),
    "llama-tied-llama3-rope": dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(),
    "qwen3": dict(head_dim=32),
    "mistral": dict(sliding_window=None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_model_logits_match_hf(case, tmp_path, smollm_tokenizer):
    _check_against_hf(case, tmp_path, smollm_tokenizer)


def test_sharded_safetensors_checkpoint(tmp_path, smollm_tokenizer):
    """Several *.safetensors files, read by several threads, load the same model."""
    _check_against_hf("llama", tmp_path, smollm_tokenizer, max_shard_size="2MB")
    assert len(list((tmp_path / "llama").glob("*.safetensors"))) > 1


def _check_against_hf(case, tmp_path, smollm_tokenizer, max_shard_size=None):
    from transformers import AutoModelForCausalLM

    arch = case.split("-")[0]
    d = make_tiny_checkpoint(arch, tmp_path / case, smollm_tokenizer, max_shard_size=max_shard_size,
                             **CASES[case])
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    llm = LLM(d, dtype="float32", kv_cache_memory_bytes=32 << 20, show_progress=False)
    assert type(llm.engine.worker.model).__name__ == hf.config.architectures[0]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (5, 17, 40)]
    assert_logprobs_match_hf(llm, hf, prompts, 8, case)

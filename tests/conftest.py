import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest
import torch

from lane.config import default_model_path

PROMPTS = [
    "Once upon a time",
    "The three primary colors are",
    "Write a short poem about the sea. The waves",
    "In computer science, a hash table is a data structure that implements an associative "
    "array, also called a dictionary. It uses a hash function to compute an index into an "
    "array of buckets, from which the desired value can be found. Explain why",
]


@pytest.fixture(scope="session")
def smollm_gguf() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def hf_smollm(smollm_gguf):
    """HF transformers' own load of the packaged GGUF, float32: the reference."""
    from transformers import AutoModelForCausalLM

    d, f = os.path.split(smollm_gguf)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def lane_smollm_fp32(smollm_gguf):
    from lane import LLM

    return LLM(smollm_gguf, dtype="float32", kv_cache_memory_bytes=512 << 20,
               max_model_len=2048, show_progress=False)


@torch.inference_mode()
def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """Plain argmax decoding with HF's KV cache; EOS is neither suppressed nor a stop."""
    out = model(torch.tensor([ids]), use_cache=True)
    past, new = out.past_key_values, []
    for _ in range(n):
        tok = int(out.logits[0, -1].argmax())
        new.append(tok)
        out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return new


@pytest.fixture(scope="session")
def smollm_tokenizer(smollm_gguf):
    from lane.config import ModelConfig

    return ModelConfig(smollm_gguf).get_tokenizer()


TINY_COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   bos_token_id=1, eos_token_id=2, initializer_range=0.2)


def make_tiny_checkpoint(arch: str, out_dir, tokenizer, max_shard_size=None, **overrides) -> str:
    """A small random HF checkpoint of ``arch`` with SmolLM2's tokenizer."""
    import transformers as tf

    cfg_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }[arch]
    torch.manual_seed(0)
    cfg = cfg_cls(**{**TINY_COMMON, **overrides})
    model = model_cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # HF zeroes / ones these: make them count
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out_dir, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


def assert_logprobs_match_hf(llm, hf, prompts: list[list[int]], n_new: int, case: str = "",
                             tol: float = 2e-4) -> None:
    """lane's greedy tokens, and its top-5 logprobs at every step, against one HF
    forward over prompt + generated tokens (float32)."""
    from lane import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n_new, logprobs=5, ignore_eos=True),
                        use_tqdm=False)
    for ids, out in zip(prompts, outs):
        gen = out.outputs[0].token_ids
        assert len(gen) == n_new
        with torch.no_grad():
            ref = hf(torch.tensor([ids + gen])).logits[0].float().log_softmax(-1)
        for t, tok in enumerate(gen):
            row = ref[len(ids) - 1 + t]
            assert tok == int(row.argmax()), (case, len(ids), t)
            lane_lp = out.outputs[0].logprobs[t]
            ref_top = row.topk(5)
            for tid, val in zip(ref_top.indices.tolist(), ref_top.values.tolist()):
                assert tid in lane_lp
                assert lane_lp[tid].logprob == pytest.approx(val, abs=tol), (case, len(ids), t, tid)


def traced_spans(llm, prompt_token_ids: list[int], max_tokens: int, layer_detail: bool = True) -> list:
    """The spans one greedy generation records with tracing on (then off again)."""
    from lane import SamplingParams
    from lane.tracing import tracer

    try:
        tracer.enable(layer_detail=layer_detail)
        tracer.drain()
        llm.generate([{"prompt_token_ids": prompt_token_ids}],
                     SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        return tracer.drain()
    finally:
        tracer.enabled = tracer.layer_detail = False
        tracer.drain()

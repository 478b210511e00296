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

"""The fused step (models/llama_decode.py: every layer of a step of decodes and prefill chunks
in one kernel call) against the module path it replaces: the same kernels in the same order, so
the same tokens and the same logprobs, bit for bit, on the embedded SmolLM2 (Q4_1 blocks,
repacked 8 rows interleaved), a tiny K-quant llama (K-quant and dense layers) and a tiny
dense Qwen2 (q/k/v biases) in bf16."""
import pytest
import torch

from lane import LLM, SamplingParams
from lane.model_executor.layers import cpu_kernels

from conftest import PROMPTS, make_tiny_checkpoint
from test_kquant import kquant_gguf  # noqa: F401  (the fixture)


def run(llm, prompts, n: int = 24):
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, logprobs=3, ignore_eos=True),
                        use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


def fused_against_modules(llm, prompts, monkeypatch):
    """Generate with the fused step, then with the module path; both must agree exactly (a
    GGUF-block model's float32 norms and rope run the kernels on both: linear.kernels_in_float32)."""
    model = llm.engine.worker.model.model
    fused = run(llm, prompts)
    plan = model._fused
    assert plan is not None and plan.steps > 0, "the fused step did not run"
    model._fused = None  # no plan: the module path
    modules = run(llm, prompts)
    assert model._fused is None
    for (ta, la), (tb, lb) in zip(fused, modules):
        assert ta == tb
        assert la == lb
    return plan


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_smollm_fused_decode_is_the_module_path(smollm_gguf, dtype, monkeypatch):
    llm = LLM(smollm_gguf, dtype=dtype, quantization="auto", show_progress=False, max_model_len=1024,
              kv_cache_memory_bytes=128 << 20, enable_prefix_caching=False)
    layer = llm.engine.worker.model.model.layers[0]
    assert layer.self_attn.qkv_proj.qx8 and layer.mlp.down_proj.qx8  # the repacked Q4_1
    plan = fused_against_modules(llm, PROMPTS, monkeypatch)  # 4 decode rows a step, then fewer
    assert plan.max_rows >= len(PROMPTS)


def test_smollm_fused_mixed_steps_are_the_module_path(smollm_gguf, monkeypatch):
    """Chunked prefill under a 16-token budget: a long prompt's chunks share steps with a short
    one's decodes, each chunk row attended on its request's table at its own position."""
    llm = LLM(smollm_gguf, dtype="bfloat16", quantization="auto", show_progress=False, max_model_len=1024,
              kv_cache_memory_bytes=128 << 20, enable_prefix_caching=False, max_num_batched_tokens=16)
    prompts = [{"prompt_token_ids": list(range(100, 100 + n))} for n in (5, 61, 37)]
    plan = fused_against_modules(llm, prompts, monkeypatch)
    assert plan.mixed_steps > 0


@pytest.mark.parametrize("kv", ["int8", "fp8_e4m3"])
def test_smollm_fused_steps_over_an_8bit_cache_are_the_module_path(smollm_gguf, kv, monkeypatch):
    """C8: the fused step writes the 8-bit cache and attends it (decode rows and chunk rows) with
    the module path's kernels, so the same tokens and logprobs, bit for bit."""
    llm = LLM(smollm_gguf, dtype="bfloat16", quantization="auto", show_progress=False, max_model_len=1024,
              kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False, max_num_batched_tokens=16,
              kv_cache_dtype=kv)
    assert llm.engine.worker.model.model.layers[0].self_attn.attn.k_cache.element_size() == 1
    prompts = [{"prompt_token_ids": list(range(100, 100 + n))} for n in (5, 61, 37)]
    plan = fused_against_modules(llm, prompts, monkeypatch)
    assert plan.cache_kind == {"int8": 1, "fp8_e4m3": 2}[kv] and plan.mixed_steps > 0


def test_kquant_and_dense_layers_fused(kquant_gguf, monkeypatch):  # noqa: F811
    llm = LLM(kquant_gguf, dtype="float32", quantization="auto", show_progress=False, max_model_len=256,
              kv_cache_memory_bytes=16 << 20, enable_prefix_caching=False)
    layers = llm.engine.worker.model.model.layers
    assert layers[0].self_attn.qkv_proj.qparts is not None  # mixed kinds: a part per kind
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 11)]
    assert fused_against_modules(llm, prompts, monkeypatch).max_rows >= 2  # parts' columns gathered
    llm.engine.worker.model.model._fused = False  # planned again
    fused_against_modules(llm, prompts[:1], monkeypatch)  # one row: each part writes its columns


def test_dense_bf16_qwen2_fused(tmp_path, smollm_gguf, monkeypatch):
    from transformers import AutoTokenizer
    import os

    d, f = os.path.split(smollm_gguf)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    path = make_tiny_checkpoint("qwen2", tmp_path / "qwen2", tok)
    llm = LLM(path, dtype="bfloat16", show_progress=False, max_model_len=256, kv_cache_memory_bytes=16 << 20,
              enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": list(range(7, 7 + n))} for n in (4, 9)]  # two rows: every CPU's dense limit
    fused_against_modules(llm, prompts, monkeypatch)


def test_cache_write_kernel_is_index_put():
    assert cpu_kernels.build()
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        kc, vc = torch.randn(6, 3, 16, 64, generator=g).to(dtype), torch.randn(6, 3, 16, 64, generator=g).to(dtype)
        qkv = torch.randn(5, (9 + 2 * 3) * 64, generator=g).to(dtype)
        k = qkv[:, 9 * 64:12 * 64].view(5, 3, 64)  # strided rows, as the model's split gives them
        v = qkv[:, 12 * 64:].view(5, 3, 64)
        slots = torch.tensor([17, 0, 95, 40, 41])
        ref_k, ref_v = kc.clone(), vc.clone()
        ref_k[slots // 16, :, slots % 16] = k
        ref_v[slots // 16, :, slots % 16] = v
        cpu_kernels.cache_write(k, v, kc, vc, slots)
        assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)

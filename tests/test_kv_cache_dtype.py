"""C8, the 8-bit KV cache (--kv-cache-dtype int8 / fp8_e4m3): the paged kernel over 8-bit
K/V and its torch path against attention over the dequantized cache, SmolLM2's perplexity and
greedy tokens against the model-dtype cache, chunking and prefix hits not changing a token,
the pool sized by the bytes as stored, and the layers that cannot keep 8 bits refused."""
import os
import subprocess
import sys

import pytest
import torch

from lane import LLM, SamplingParams
from lane.bench.quality import perplexity
from lane.model_executor.layers import cpu_kernels
from lane.model_executor.layers.attention import (attention_8bit_torch, decode_attention_torch, dequantize_8bit,
                                                  quantize_rows_8bit)

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_8bit_paged_attention_equals_attention_over_the_dequantized_cache(fp8, dtype):
    """Rows quantized by the kernel's cache write equal torch's (int8 exactly, fp8 within a
    rounding); the kernel and the torch path over the 8-bit cache equal float attention over
    its dequantized copy; GQA 8 query heads on 2 KV heads, ragged contexts, shared blocks."""
    torch.manual_seed(0)
    nb, kvh, bs, d, T = 12, 2, 16, 64, 100
    k, v = torch.randn(T, kvh, d).to(dtype) * 3, torch.randn(T, kvh, d).to(dtype)
    store = torch.uint8 if fp8 else torch.int8
    kc, vc = torch.zeros(nb, kvh, bs, d, dtype=store), torch.zeros(nb, kvh, bs, d, dtype=store)
    ks, vs = torch.zeros(nb, kvh, bs), torch.zeros(nb, kvh, bs)
    slots = torch.arange(bs, bs + T)  # blocks 1..7 (block 0: the null block)
    assert cpu_kernels.build()
    cpu_kernels.cache_write_8bit(k, v, kc, vc, ks, vs, slots, fp8)
    q8, s8 = quantize_rows_8bit(k, fp8)
    blk, off = slots // bs, slots % bs
    assert torch.allclose(ks[blk, :, off], s8)
    mismatched = (kc[blk, :, off] != q8).sum()
    assert mismatched == 0 if not fp8 or dtype == torch.float32 else mismatched < 0.01 * q8.numel()
    kd, vd = dequantize_8bit(kc, ks, fp8), dequantize_8bit(vc, vs, fp8)
    assert (kd[blk, :, off] - k.float()).abs().max() <= (0.07 if fp8 else 0.01) * k.float().abs().max()
    q = torch.randn(3, 8, d).to(dtype)
    tables = torch.tensor([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7], [2, 3, 0, 0, 0, 0, 0]])
    lens = torch.tensor([100, 37, 20], dtype=torch.int32)
    ref = decode_attention_torch(q.float(), kd, vd, tables, lens, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for attend in (cpu_kernels.decode_attention_8bit, attention_8bit_torch):
        got = attend(q, kc, vc, ks, vs, tables, lens, 0.125, fp8)
        assert got.dtype == dtype and torch.allclose(got.float(), ref, atol=tol), (attend.__name__, fp8)
    # the torch path in passes of two blocks: the online softmax across passes
    got = attention_8bit_torch(q, kc, vc, ks, vs, tables, lens, 0.125, fp8, blocks_per_pass=2)
    assert torch.allclose(got.float(), ref, atol=tol)


@pytest.fixture(scope="module")
def smollm_fp32():
    kw = dict(dtype="float32", quantization="none", show_progress=False, max_model_len=1024,
              kv_cache_memory_bytes=64 << 20)
    llms = {kd: LLM(kv_cache_dtype=kd, **kw) for kd in ("auto", "int8")}
    yield llms
    for llm in llms.values():
        llm.shutdown()


def test_smollm_int8_cache_perplexity_and_pool(smollm_fp32):
    """SmolLM2 (float32, dequantized) on this README: perplexity with the int8 cache within
    1.5% of the float32 cache's; the pool holds as many more blocks as its bytes per token are
    fewer (scales included)."""
    auto, int8 = smollm_fp32["auto"], smollm_fp32["int8"]
    ids = auto.get_tokenizer().encode(open(README).read())[:512]
    ppl = {kd: perplexity(llm, ids) for kd, llm in smollm_fp32.items()}
    assert abs(ppl["int8"] / ppl["auto"] - 1) < 0.015, ppl
    ka, k8 = auto.engine.kv_cache_config, int8.engine.kv_cache_config
    page = {kd: llm.engine.kv_cache_config.groups[0].page_size_bytes for kd, llm in smollm_fp32.items()}
    # float32: 2 x 3 x 64 x 4 B per token and layer; int8: 2 x 3 x (64 + 4) B
    assert page["auto"] / page["int8"] == pytest.approx(1536 / 408)
    assert k8.num_blocks[0] == pytest.approx(ka.num_blocks[0] * 1536 / 408, rel=0.01)


def test_smollm_int8_cache_tokens_do_not_depend_on_chunks_or_prefix_hits(smollm_fp32):
    """A prefill chunk's rows are attended as decode rows over the 8-bit cache: 8-token chunks,
    one whole chunk and a prefix-cache hit give the same greedy tokens; most match the float32
    cache's."""
    int8 = smollm_fp32["int8"]
    prompts = ["The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
               "combined movable metal type, oil-based ink and a wooden press. Within fifty years",
               "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively so that "
               "large n do not overflow the stack.\"\"\"\n    "]  # longer than a block: hits
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    whole = [o.outputs[0].token_ids for o in int8.generate(prompts, sp, use_tqdm=False)]
    hits = int8.prefix_cache_stats.hits
    again = [o.outputs[0].token_ids for o in int8.generate(prompts, sp, use_tqdm=False)]
    assert int8.prefix_cache_stats.hits > hits and again == whole
    chunked = LLM(dtype="float32", quantization="none", show_progress=False, max_model_len=1024,
                  kv_cache_memory_bytes=64 << 20, kv_cache_dtype="int8", max_num_batched_tokens=8,
                  enable_prefix_caching=False)
    try:
        assert [o.outputs[0].token_ids for o in chunked.generate(prompts, sp, use_tqdm=False)] == whole
    finally:
        chunked.shutdown()
    ref = [o.outputs[0].token_ids for o in smollm_fp32["auto"].generate(prompts, sp, use_tqdm=False)]
    assert sum(a == b for x, y in zip(whole, ref) for a, b in zip(x, y)) >= 0.5 * 64


def test_8bit_cache_refused_where_a_layer_cannot_keep_it(tmp_path):
    """MLA's latent cache is not kept in 8 bits yet: refused with the layer named; an unknown
    --kv-cache-dtype is a CLI error naming the flag."""
    from lane.entrypoints.tiny_model import write_tiny_model

    d = write_tiny_model("deepseek_v3", str(tmp_path / "v3"))
    with pytest.raises(ValueError, match="MLAAttention"):
        LLM(d, dtype="float32", kv_cache_dtype="int8", show_progress=False, kv_cache_memory_bytes=8 << 20)
    r = subprocess.run([sys.executable, "-m", "lane.entrypoints.cli", "generate", "hi", "--kv-cache-dtype", "int4"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--kv-cache-dtype" in r.stderr and "Traceback" not in r.stderr

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
from lane.model_executor.layers.attention import (CacheLayer, attention_8bit_torch, decode_attention_torch, dequantize_8bit,
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


def test_int8_cache_write_of_rows_with_nan_inf_or_no_scale():
    """The int8 write's vector rounding keeps the scalar rounding's bytes where a row is not
    plain: a NaN value stores 0, a row holding inf (scale inf) stores 0s, and a row too small to
    invert its scale stores 0s; a plain row beside them is torch's quantization."""
    assert cpu_kernels.build()
    g = torch.Generator().manual_seed(2)
    rows = torch.randn(4, 1, 64, generator=g)
    rows[1, 0, 5], rows[2, 0, 9] = float("nan"), float("inf")
    rows[3] = 1e-38
    kc, vc = torch.zeros(1, 1, 16, 64, dtype=torch.int8), torch.zeros(1, 1, 16, 64, dtype=torch.int8)
    ks, vs = torch.zeros(1, 1, 16), torch.zeros(1, 1, 16)
    cpu_kernels.cache_write_8bit(rows, rows, kc, vc, ks, vs, torch.arange(4), False)
    clean = rows[:2].clone()
    clean[1, 0, 5] = 0.0  # the NaN's row as if it were 0 there: the same scale
    q8, _ = quantize_rows_8bit(clean, False)
    assert torch.equal(kc[0, 0, :2], q8[:, 0])
    assert not kc[0, 0, 2].any() and not kc[0, 0, 3].any() and torch.equal(kc, vc)


@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8_e4m3"])
def test_8bit_cache_chunk_rows_equal_decode_rows(fp8):
    """bf16 rows over an 8-bit cache, on whichever kernel this CPU runs (the AMX tiles, each block
    dequantized to bf16 as it is packed; int8 on AVX-512 VNNI, in integer dot products; fp8 on
    AVX512-BF16, each byte widened to bf16; else the float kernel): within bf16 rounding of a float64 softmax over the dequantized cache, and a
    prefill chunk's rows (one table, each at its own context length) bit for bit the rows a
    decode step gives, alone or in a batch big enough that a request's KV heads go through the
    context together. Head groups of 3, 16, 7 and 5: every split of a group into the kernels'
    chunks of heads."""
    assert cpu_kernels.build()
    g = torch.Generator().manual_seed(5)
    for H, KVH, D in ((9, 3, 64), (16, 1, 128), (14, 2, 64), (10, 2, 128)):
        nb, n = 24, 90
        k, v = torch.randn(nb * 16, KVH, D, generator=g) * 3, torch.randn(nb * 16, KVH, D, generator=g)
        store = torch.uint8 if fp8 else torch.int8
        kc, vc = torch.zeros(nb, KVH, 16, D, dtype=store), torch.zeros(nb, KVH, 16, D, dtype=store)
        ks, vs = torch.zeros(nb, KVH, 16), torch.zeros(nb, KVH, 16)
        cpu_kernels.cache_write_8bit(k.to(torch.bfloat16), v.to(torch.bfloat16), kc, vc, ks, vs,
                                     torch.arange(nb * 16), fp8)
        ids = torch.randperm(nb, generator=g)[:6]
        q = torch.randn(n, H, D, generator=g).to(torch.bfloat16)
        lens = torch.arange(1, n + 1, dtype=torch.int32)
        rows = cpu_kernels.decode_attention_8bit(q, kc, vc, ks, vs, ids, lens, 0.125, fp8)
        kd = dequantize_8bit(kc, ks, fp8)[ids].permute(1, 0, 2, 3).reshape(KVH, -1, D).double()
        vd = dequantize_8bit(vc, vs, fp8)[ids].permute(1, 0, 2, 3).reshape(KVH, -1, D).double()
        for i in range(0, n, 7):
            s = torch.einsum("hgd,hld->hgl", q[i].double().view(KVH, -1, D), kd[:, :i + 1]) * 0.125
            ref = torch.einsum("hgl,hld->hgd", torch.softmax(s, -1), vd[:, :i + 1]).reshape(H, D)
            torch.testing.assert_close(rows[i].double(), ref, atol=3e-2, rtol=3e-2)
        for i in (0, 31, 32, 57, 89):
            alone = cpu_kernels.decode_attention_8bit(q[i:i + 1], kc, vc, ks, vs, ids[None], lens[i:i + 1], 0.125, fp8)
            assert torch.equal(alone, rows[i:i + 1]), (H, D, i)
        pick = torch.arange(0, n, 3)
        batch = cpu_kernels.decode_attention_8bit(q[pick], kc, vc, ks, vs, ids.expand(len(pick), -1).contiguous(),
                                                  lens[pick], 0.125, fp8)
        assert torch.equal(batch, rows[pick]), (H, D)


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
    ids = auto.get_tokenizer().encode(open(README).read())[:384]
    ppl = {kd: perplexity(llm, ids) for kd, llm in smollm_fp32.items()}
    assert abs(ppl["int8"] / ppl["auto"] - 1) < 0.015, ppl
    ka, k8 = auto.engine.kv_cache_config, int8.engine.kv_cache_config
    page = {kd: llm.engine.kv_cache_config.groups[0].page_size_bytes for kd, llm in smollm_fp32.items()}
    # float32: 2 x 3 x 64 x 4 B per token and layer; int8: 2 x 3 x (64 + 4) B
    assert page["auto"] / page["int8"] == pytest.approx(1536 / 408)
    assert k8.num_blocks[0] == pytest.approx(ka.num_blocks[0] * 1536 / 408, rel=0.01)


def test_smollm_int8_cache_tokens_do_not_depend_on_chunks_or_prefix_hits(smollm_fp32):
    """A prefill chunk's rows are attended as decode rows over the 8-bit cache: 16-token chunks,
    one whole chunk and a prefix-cache hit give the same greedy tokens; most match the float32
    cache's."""
    int8 = smollm_fp32["int8"]
    prompts = ["The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
               "combined movable metal type, oil-based ink and a wooden press. Within fifty years",
               "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively so that "
               "large n do not overflow the stack.\"\"\"\n    "]  # longer than a block: hits
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    whole = [o.outputs[0].token_ids for o in int8.generate(prompts, sp, use_tqdm=False)]
    hits = int8.prefix_cache_stats.hits
    again = [o.outputs[0].token_ids for o in int8.generate(prompts, sp, use_tqdm=False)]
    assert int8.prefix_cache_stats.hits > hits and again == whole
    chunked = LLM(dtype="float32", quantization="none", show_progress=False, max_model_len=1024,
                  kv_cache_memory_bytes=64 << 20, kv_cache_dtype="int8", max_num_batched_tokens=16,
                  enable_prefix_caching=False)
    try:
        assert [o.outputs[0].token_ids for o in chunked.generate(prompts, sp, use_tqdm=False)] == whole
    finally:
        chunked.shutdown()
    ref = [o.outputs[0].token_ids for o in smollm_fp32["auto"].generate(prompts, sp, use_tqdm=False)]
    assert sum(a == b for x, y in zip(whole, ref) for a, b in zip(x, y)) >= 0.5 * 32


def test_smollm_bf16_int8_cache_tokens_do_not_depend_on_chunks_or_prefix_hits():
    """The same in bf16, whose rows take the 8-bit kernel for 16-bit queries (on AVX-512 VNNI: the
    integer one): 16-token chunks, whole prompts and a prefix-cache hit give the same tokens."""
    prompts = ["The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
               "combined movable metal type, oil-based ink and a wooden press. Within fifty years",
               "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen; its first stage"]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = _tokens_in_chunks_and_after_hits(lambda chunk: LLM(
        dtype="bfloat16", show_progress=False, max_model_len=1024, kv_cache_memory_bytes=64 << 20,
        kv_cache_dtype="int8", max_num_batched_tokens=chunk), prompts, sp)
    assert outs[0] == outs[1] == outs[2] == outs[3]


def _tokens_in_chunks_and_after_hits(make_llm, prompts, sp) -> list:
    """Each prompt's greedy tokens from an engine of 16-token chunks and one of whole prompts
    (make_llm(chunk)), each run twice: the second run a prefix-cache hit (asserted)."""
    outs = []
    for chunk in (16, 2048):
        llm = make_llm(chunk)
        try:
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
            hits = llm.prefix_cache_stats.hits
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)])
            assert llm.prefix_cache_stats.hits > hits
        finally:
            llm.shutdown()
    return outs


def test_8bit_cache_refused_where_a_layer_cannot_keep_it():
    """A cache layer that cannot keep 8 bits (a plugin's, say) is refused by name; an unknown
    --kv-cache-dtype is a CLI error naming the flag."""
    from lane.kv_cache_interface import FullAttentionSpec
    from lane.model_executor.layers.attention import CacheLayer, set_kv_cache_dtype

    class PluginCache(CacheLayer):
        def kv_cache_specs(self, block_size, dtype, enable_prefix_caching):
            return {"cache": FullAttentionSpec(block_size, dtype, 1, 8)}

    model = torch.nn.Sequential(PluginCache())
    with pytest.raises(ValueError, match="PluginCache"):
        set_kv_cache_dtype(model, "int8")
    set_kv_cache_dtype(model, "auto")
    r = subprocess.run([sys.executable, "-m", "lane.entrypoints.cli", "generate", "hi", "--kv-cache-dtype", "int4"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--kv-cache-dtype" in r.stderr and "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    from lane.entrypoints.tiny_model import write_tiny_model

    root = tmp_path_factory.mktemp("c8-deepseek")
    return {arch: write_tiny_model(arch, str(root / arch)) for arch in ("deepseek_v3", "deepseek_v32", "deepseek_v4")}


DS_KW = dict(dtype="float32", show_progress=False, kv_cache_memory_bytes=16 << 20, max_model_len=256)


# (fp8 for V4: through the PD connector in test_pd; served int8: test_seed_shape)
@pytest.mark.parametrize("arch,kind", [("deepseek_v3", "int8"), ("deepseek_v32", "int8"), ("deepseek_v4", "int8")])
def test_deepseek_8bit_caches_do_not_depend_on_chunks_or_prefix_hits(tiny_deepseek, arch, kind):
    """MLA's latent, V3.2's indexer keys and V4's window, entries and indexer keys in 8 bits:
    16-token chunks, whole prompts and prefix-cache hits give the same greedy tokens."""
    g = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 49152, (n,), generator=g).tolist()} for n in (7, 40, 70)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = _tokens_in_chunks_and_after_hits(
        lambda chunk: LLM(tiny_deepseek[arch], kv_cache_dtype=kind, max_num_batched_tokens=chunk, **DS_KW), prompts, sp)
    assert outs[0] == outs[1] == outs[2] == outs[3]


def _first_sparse_selection(llm, arch: str, ids: list[int]) -> torch.Tensor:
    """The chosen keys [rows, context] of the first sparse layer for one prompt in one chunk."""
    from lane.bench.quality import teacher_forced_logits

    model = llm.engine.worker.model
    got = []
    if arch == "deepseek_v32":
        owner, name = model.model.layers[0].self_attn.indexer, "forward"
        pick = lambda sel: got.extend(m for m in sel.prefill_masks if m is not None)  # noqa: E731
    else:
        owner, name = next(layer.attn for layer in model.layers if layer.attn.indexer is not None), "_select"
        pick = got.append
    orig = getattr(owner, name)

    def spy(*args, **kwargs):
        out = orig(*args, **kwargs)
        pick(out)
        return out
    setattr(owner, name, spy)
    try:
        teacher_forced_logits(llm, ids, len(ids))
    finally:
        setattr(owner, name, orig)
    return got[0]


@pytest.mark.parametrize("arch", ["deepseek_v32", "deepseek_v4"])
def test_indexer_topk_with_8bit_keys_agrees_with_bf16(tiny_deepseek, arch, monkeypatch):
    """li_c8: the first sparse layer's top-k sets with int8 indexer keys (and the rest of the
    cache in int8) against bf16's, on rows whose context is at least 4 x index_topk (V3.2: 16
    tokens' keys of 80; V4: 8 entries of 40, one per 4 tokens): at least 95% of entries shared."""
    n, topk, rate = (80, 16, 1) if arch == "deepseek_v32" else (160, 8, 4)
    ids = torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(3)).tolist()
    sel = {}
    for kind in ("auto", "int8"):
        llm = LLM(tiny_deepseek[arch], kv_cache_dtype=kind, **dict(DS_KW, dtype="bfloat16"))
        try:
            sel[kind] = _first_sparse_selection(llm, arch, ids)
        finally:
            llm.shutdown()
    rows = slice(4 * topk * rate - 1, n)  # the rows that see at least 4 x index_topk keys
    bf16, int8 = sel["auto"][rows], sel["int8"][rows]
    assert bool((bf16.sum(-1) == topk).all())
    assert float((bf16 & int8).sum() / bf16.sum()) >= 0.95
    # the 8-bit keys scored two blocks a pass (V4: 40 entries in 5 passes): the same choices as in one
    monkeypatch.setattr(CacheLayer, "c8_pass_blocks", 2)
    llm = LLM(tiny_deepseek[arch], kv_cache_dtype="int8", **dict(DS_KW, dtype="bfloat16"))
    try:
        assert torch.equal(_first_sparse_selection(llm, arch, ids), sel["int8"])
    finally:
        llm.shutdown()


def test_v4_attention_over_passes_equals_one_pass():
    """C8's V4 attention: the context in parts (a window, then passes of entries, one that no
    row may see) merged by the online softmax from the sink equals one softmax over it all,
    for a chunk's rows against one context and for decodes against their own."""
    from lane.model_executor.layers.compressed_attention import attend_with_sinks

    torch.manual_seed(0)
    n, H, d, L = 5, 4, 32, 40
    q, sinks = torch.randn(n, H, d), torch.randn(H)
    for keys in (torch.randn(L, d), torch.randn(n, L, d)):  # a chunk's context; a context per decode
        allowed = torch.rand(n, L) < 0.6
        allowed[:, 24:32] = False
        whole = attend_with_sinks(q, [(keys, allowed)], sinks, 0.2)
        cuts = [(0, 8), (8, 24), (24, 32), (32, 40)]
        parts = [(keys[..., a:b, :], allowed[:, a:b]) for a, b in cuts]
        assert torch.allclose(attend_with_sinks(q, parts, sinks, 0.2), whole, atol=1e-6)


def test_dsa_context_parallel_with_8bit_caches_equals_one_rank(tiny_deepseek):
    """V3.2 over two ranks with sequence and DSA context parallelism, its latent and indexer keys
    in int8: one rank's int8 tokens."""
    prompts = [{"prompt_token_ids": list(range(100, 148))}, {"prompt_token_ids": list(range(200, 230))}]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(DS_KW, kv_cache_dtype="int8", max_num_batched_tokens=32)
    one = LLM(tiny_deepseek["deepseek_v32"], **kw)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, sp, use_tqdm=False)]
    one.shutdown()
    two = LLM(tiny_deepseek["deepseek_v32"], tensor_parallel_size=2, enable_sequence_parallel=True,
              enable_dsa_cp=True, **kw)
    try:
        assert [o.outputs[0].token_ids for o in two.generate(prompts, sp, use_tqdm=False)] == want
    finally:
        two.shutdown()

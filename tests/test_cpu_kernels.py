"""The compiled CPU kernels against the torch reference paths."""
import contextlib
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from lane.model_executor.layers import cpu_kernels
from lane.model_executor.layers.attention import decode_attention_torch


@pytest.fixture(scope="module", autouse=True)
def built():
    # a machine with a C++ compiler (every machine lane supports) must build them
    assert cpu_kernels.build(), "the CPU kernels failed to build"


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("kvh, g, d, bs", [(3, 3, 64, 16), (2, 1, 32, 8), (1, 8, 128, 16), (4, 2, 48, 32),
                                         (2, 2, 64, 32), (2, 4, 128, 8)])
def test_paged_decode_attention(dtype, tol, kvh, g, d, bs):
    torch.manual_seed(0)
    nb, B = 64, 6
    lens = torch.tensor([1, bs - 1, bs, bs + 1, 3 * bs + 5, 7 * bs], dtype=torch.int32)
    max_blocks = int((lens.max() + bs - 1) // bs)
    kc = torch.randn(nb, kvh, bs, d).to(dtype)
    vc = torch.randn(nb, kvh, bs, d).to(dtype)
    tables = torch.stack([torch.randperm(nb - 1)[:max_blocks] + 1 for _ in range(B)])
    q = torch.randn(B, kvh * g, d).to(dtype)
    ref = decode_attention_torch(q, kc, vc, tables, lens, d ** -0.5).float()
    out = cpu_kernels.decode_attention(q, kc, vc, tables, lens, d ** -0.5).float()
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_paged_decode_attention_one_kv_head_splits_query_heads(dtype, tol):
    """MLA's absorbed decode: one latent "KV head" of 576 (DeepSeek V3), K = V = the cache,
    fewer requests than threads: the query heads are split over the threads."""
    torch.manual_seed(0)
    prev = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        nb, bs, d, H = 32, 16, 576, 16
        cache = torch.randn(nb, 1, bs, d).to(dtype)
        for B, lens in ((1, [37]), (2, [5, 70])):
            lens = torch.tensor(lens, dtype=torch.int32)
            tables = torch.stack([torch.randperm(nb - 1)[:5] + 1 for _ in range(B)])
            q = torch.randn(B, H, d).to(dtype)
            ref = decode_attention_torch(q, cache, cache, tables, lens, 0.1).float()
            out = cpu_kernels.decode_attention(q, cache, cache, tables, lens, 0.1).float()
            torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 13, 32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n,k", [(200, 96), (203, 100)])  # fp32: 4-row blocks, whole vectors, and tails
def test_small_m_linear(dtype, tol, m, bias, n, k):
    torch.manual_seed(m)
    w = torch.randn(n, k).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    x = torch.randn(m, k).to(dtype)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    out = cpu_kernels.small_m_linear(x, w, b)
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out.float(), ref, atol=tol * 10, rtol=tol)


def test_bf16_amx_tiles_match_torch_and_keep_rows_apart():
    """Dense bf16 layers on AMX-BF16 tiles (every M, where the CPU has them): each output within
    bf16 rounding of the fp32 reference, and each row bit for bit the same alone, in any batch, at
    any position in it; a shape the tiles do not take (K % 32) runs the FMA kernel."""
    if not cpu_kernels.bf16_amx():
        pytest.skip("no AMX-BF16 here (or LANE_CPU_AMX=0): bf16 layers run the FMA kernel")
    g = torch.Generator().manual_seed(3)
    for N, K in ((48, 64), (96, 576), (64, 1536), (80, 100)):  # a lone weight tile, pairs, K tail
        w = torch.randn(N, K, generator=g).to(torch.bfloat16)
        b = torch.randn(N, generator=g).to(torch.bfloat16)
        # 266 rows: K = 1536 takes the rows in blocks of 256 (bf16_amx.cpp's kBlockBytes), the last of 10
        x = torch.randn(266, K, generator=g).to(torch.bfloat16)
        for bias in (None, b):
            y = cpu_kernels.small_m_linear(x, w, bias)
            ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
            torch.testing.assert_close(y.float(), ref, atol=0.05, rtol=1e-2)
            perm = torch.randperm(266, generator=g)
            assert torch.equal(cpu_kernels.small_m_linear(x[perm], w, bias), y[perm]), (N, K)
            for M in (1, 15, 16, 17, 33):
                assert torch.equal(cpu_kernels.small_m_linear(x[:M], w, bias), y[:M]), (N, K, M)
                assert torch.equal(cpu_kernels.small_m_linear(x[M:M + 1], w, bias), y[M:M + 1]), (N, K, M)


@contextlib.contextmanager
def bf16_attention_kernel(kernel: str):
    """Run bf16 paged attention on one kernel: "amx" (the AMX-BF16 tiles), "dpbf16" (AVX512-BF16's
    vdpbf16ps) or "fp32" (the vector kernel that widens K and V); skip where this CPU lacks it."""
    try:
        if kernel == "amx":
            if not cpu_kernels.attention_amx(True):
                pytest.skip("no AMX-BF16 here (or LANE_CPU_AMX=0)")
        else:
            cpu_kernels.attention_amx(False)
            if cpu_kernels.attention_dpbf16(kernel == "dpbf16") != (kernel == "dpbf16"):
                pytest.skip("no AVX512-BF16 here")
            if kernel == "fp32" and cpu_kernels.isa() != "avx512":
                pytest.skip("the fp32 vector kernel is AVX-512's")
        yield
    finally:
        cpu_kernels.attention_amx(True)
        cpu_kernels.attention_dpbf16(True)


@pytest.mark.parametrize("kernel", ["amx", "dpbf16", "fp32"])
def test_bf16_attention_chunk_rows_equal_decode_rows(kernel):
    """Paged attention over a bf16 cache, on each kernel this CPU has: a prefill chunk's rows
    (positions 37..81, crossing blocks and 32-key steps) within bf16 rounding of a float64
    softmax, and each bit for bit the row a decode step gives at that position, alone or among
    other requests, from other physical blocks holding the same K/V."""
    with bf16_attention_kernel(kernel):
        _chunk_rows_equal_decode_rows()


@pytest.mark.parametrize("kernel", ["amx", "dpbf16", "fp32"])
def test_bf16_attention_ignores_the_cache_past_the_context(kernel):
    """The slots of a request's last block past its context hold whatever was there (NaN here):
    every bf16 kernel leaves them out of the scores and the sums, at every length of the block."""
    g = torch.Generator().manual_seed(5)
    H, KVH, D, bs = 9, 3, 64, 16
    kc = torch.randn(8, KVH, bs, D, generator=g).to(torch.bfloat16)
    vc = torch.randn(8, KVH, bs, D, generator=g).to(torch.bfloat16)
    lens = torch.tensor([17, 18, 23, 31, 32, 3], dtype=torch.int32)
    tables = torch.tensor([[1, 2], [1, 2], [1, 2], [1, 2], [1, 2], [5, 0]])
    q = torch.randn(len(lens), H, D, generator=g).to(torch.bfloat16)
    with bf16_attention_kernel(kernel):
        for i in range(len(lens)):  # one request at a time: its own slots past its length poisoned
            poisoned_k, poisoned_v = kc.clone(), vc.clone()
            last, used = int(tables[i, (lens[i] - 1) // bs]), (int(lens[i]) - 1) % bs + 1
            poisoned_k[last, :, used:], poisoned_v[last, :, used:] = float("nan"), float("nan")
            clean = cpu_kernels.decode_attention(q[i:i + 1], kc, vc, tables[i:i + 1], lens[i:i + 1], 0.125)
            out = cpu_kernels.decode_attention(q[i:i + 1], poisoned_k, poisoned_v, tables[i:i + 1], lens[i:i + 1], 0.125)
            assert torch.isfinite(out).all(), (kernel, int(lens[i]))
            assert torch.equal(out, clean), (kernel, int(lens[i]))


@pytest.mark.parametrize("kernel", ["dpbf16", "fp32"])
def test_bf16_attention_chunk_rows_ignore_later_positions(kernel):
    """A chunk's rows share each block's K and V up to the chunk's longest row: a row must not
    touch the keys after its own position, even where one of them is infinite (the AVX512-BF16
    kernel takes V by pairs of keys: a row whose last key is the first of a pair must pair it
    with zeros, as a decode row alone does, not with the next position's row times 0)."""
    g = torch.Generator().manual_seed(6)
    H, KVH, D, done, n = 9, 3, 64, 16, 12
    kc = torch.randn(8, KVH, 16, D, generator=g).to(torch.bfloat16)
    vc = torch.randn(8, KVH, 16, D, generator=g).to(torch.bfloat16)
    ids = torch.tensor([3, 1, 6])
    kc[ids[1], :, 5], vc[ids[1], :, 5] = float("inf"), float("inf")  # position 21
    q = torch.randn(n, H, D, generator=g).to(torch.bfloat16)
    with bf16_attention_kernel(kernel):
        rows = cpu_kernels.prefill_rows_attention(q, kc, vc, ids, done, 0.125)
        for i in range(5):  # positions 16..20: their contexts end before 21 (row 4's last key pairs with it)
            alone = cpu_kernels.decode_attention(q[i:i + 1], kc, vc, ids[None], torch.tensor([done + i + 1],
                                                                                           dtype=torch.int32), 0.125)
            assert torch.isfinite(rows[i]).all(), (kernel, i)
            assert torch.equal(rows[i:i + 1], alone), (kernel, i)


def test_dpbf16_attention_is_the_kernel_that_runs():
    """Where the CPU has AVX512-BF16 (and the AMX tiles are off), bf16 attention runs vdpbf16ps:
    its query and probabilities rounded to bf16 make it differ from the fp32 kernel's, within
    bf16 rounding."""
    g = torch.Generator().manual_seed(7)
    kc = torch.randn(16, 3, 16, 64, generator=g).to(torch.bfloat16)
    vc = torch.randn(16, 3, 16, 64, generator=g).to(torch.bfloat16)
    q = torch.randn(4, 9, 64, generator=g).to(torch.bfloat16)
    tables, lens = torch.arange(16).view(4, 4), torch.tensor([64, 50, 33, 7], dtype=torch.int32)
    with bf16_attention_kernel("dpbf16"):
        dp = cpu_kernels.decode_attention(q, kc, vc, tables, lens, 0.125)
    with bf16_attention_kernel("fp32"):
        fp = cpu_kernels.decode_attention(q, kc, vc, tables, lens, 0.125)
    assert not torch.equal(dp, fp)
    torch.testing.assert_close(dp.float(), fp.float(), atol=2e-2, rtol=2e-2)


def _chunk_rows_equal_decode_rows():
    g = torch.Generator().manual_seed(4)
    # (AMX: 5 positions a tile, 1, 1 (16 heads); AVX512-BF16: heads loaded with each K / V row
    # in groups of 4 (D = 64) or 2 (D = 128), and the rest: 3, 2 x 8, 4 x 4, 4 + 3, 2 + 2 + 1)
    for H, KVH, D in ((9, 3, 64), (16, 1, 128), (32, 2, 64), (14, 2, 64), (10, 2, 128)):
        nb, done, n = 48, 37, 45
        kc = torch.randn(nb, KVH, 16, D, generator=g).to(torch.bfloat16)
        vc = torch.randn(nb, KVH, 16, D, generator=g).to(torch.bfloat16)
        ids = torch.randperm(nb // 2, generator=g)[:6]
        q = torch.randn(n, H, D, generator=g).to(torch.bfloat16)
        rows = cpu_kernels.prefill_rows_attention(q, kc, vc, ids, done, 0.125)
        k = kc[ids].permute(1, 0, 2, 3).reshape(KVH, -1, D).double()
        v = vc[ids].permute(1, 0, 2, 3).reshape(KVH, -1, D).double()
        for i in range(n):
            L = done + i + 1
            s = torch.einsum("hgd,hld->hgl", q[i].double().view(KVH, -1, D), k[:, :L]) * 0.125
            ref = torch.einsum("hgl,hld->hgd", torch.softmax(s, -1), v[:, :L]).reshape(H, D)
            torch.testing.assert_close(rows[i].double(), ref, atol=2e-2, rtol=2e-2)
        moved = ids + nb // 2  # the same K/V in other blocks
        kc[moved], vc[moved] = kc[ids], vc[ids]
        for i in (0, 10, 11, 26, 44):  # decode rows at positions 37, 47, 48, 63, 81
            alone = cpu_kernels.decode_attention(q[i:i + 1], kc, vc, moved[None], torch.tensor([done + i + 1],
                                                                                           dtype=torch.int32), 0.125)
            assert torch.equal(alone, rows[i:i + 1]), (H, KVH, D, i)
        tables = torch.stack([moved, ids, moved])
        lens = torch.tensor([done + 12, done + 45, 3], dtype=torch.int32)
        batch = cpu_kernels.decode_attention(q[[11, 44, 0]], kc, vc, tables, lens, 0.125)
        assert torch.equal(batch[:2], rows[[11, 44]]), (H, KVH, D)
        # a batch big enough that each request's KV heads go through the context together
        pick = torch.arange(0, n, 2)
        tables = torch.stack([moved if i % 4 else ids for i in range(len(pick))])
        batch = cpu_kernels.decode_attention(q[pick], kc, vc, tables, (done + pick + 1).to(torch.int32), 0.125)
        assert torch.equal(batch, rows[pick]), (H, KVH, D)


def test_engine_output_same_without_kernels(tmp_path, smollm_tokenizer):
    """The torch fallback paths (LANE_CPU_KERNELS=0) give the same greedy tokens."""
    from conftest import make_tiny_checkpoint

    d = make_tiny_checkpoint("llama", tmp_path / "m", smollm_tokenizer)
    code = (
        "from lane import LLM, SamplingParams\n"
        f"llm = LLM({d!r}, dtype='float32', kv_cache_memory_bytes=16 << 20, show_progress=False)\n"
        "ps = [{'prompt_token_ids': list(range(5, 5 + n))} for n in (3, 20, 45)]\n"
        "outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)\n"
        "print([o.outputs[0].token_ids for o in outs])\n")
    runs = []
    for flag in ("1", "0"):
        env = {**os.environ, "LANE_CPU_KERNELS": flag, "HF_HUB_OFFLINE": "1"}
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        runs.append(r.stdout.strip().splitlines()[-1])
    assert runs[0] == runs[1]


def test_fused_rms_norm_rotary_silu_match_torch():
    """bf16 fused kernels against the torch formulas (one rounding instead of several)."""
    from lane.model_executor.layers.activation import silu_and_mul
    from transformers import LlamaConfig

    from lane.model_executor.layers.layernorm import RMSNorm
    from lane.model_executor.layers.rotary_embedding import RotaryEmbedding

    torch.manual_seed(0)
    bf = torch.bfloat16
    x = torch.randn(37, 96).to(bf)
    res = torch.randn(37, 96).to(bf)
    norm = RMSNorm(96, 1e-5).to(bf)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96) + 0.5)
    # torch reference in fp32
    s = x.float() + res.float()
    ref = F.rms_norm(s, (96,), eps=1e-5) * norm.weight.float()
    out, new_res = norm(x.clone(), res.clone())
    torch.testing.assert_close(new_res.float(), s, atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), ref, atol=6e-2, rtol=2e-2)
    torch.testing.assert_close(norm(x).float(), F.rms_norm(x.float(), (96,), eps=1e-5) * norm.weight.float(),
                               atol=6e-2, rtol=2e-2)
    # rope on strided views of a fused qkv buffer, as the attention layer calls it
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, rope_theta=10000.0)
    rope = RotaryEmbedding(cfg, 64, 128)
    qkv = torch.randn(9, 6 * 64).to(bf)
    pos = torch.tensor([0, 1, 2, 5, 17, 40, 41, 100, 127])
    q, k = qkv[:, :256].view(9, 4, 64), qkv[:, 256:320].view(9, 1, 64)
    cos, sin = rope.cos[pos].unsqueeze(1), rope.sin[pos].unsqueeze(1)
    ref_q = rope._apply(q.float(), cos, sin)
    ref_k = rope._apply(k.float(), cos, sin)
    v_before = qkv[:, 320:].clone()
    q2, k2 = rope(rope.prepare(pos, bf), q, k)
    torch.testing.assert_close(q2.float(), ref_q, atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(k2.float(), ref_k, atol=3e-2, rtol=1e-2)
    assert torch.equal(qkv[:, 320:], v_before)  # V untouched
    gu = torch.randn(11, 2 * 48).to(bf)
    torch.testing.assert_close(silu_and_mul(gu).float(), F.silu(gu[:, :48].float()) * gu[:, 48:].float(),
                               atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_argmax_rows_is_torch_argmax(dtype):
    """The greedy sampler's kernel gives torch.argmax's index on every row: the first of tied
    maxima, the first NaN where a row has one, 0 for a row of -inf; bf16 rows tie often."""
    assert cpu_kernels.build()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 49153, generator=g).to(dtype)
    x[1, 40000] = x[1, 7] = x[1].max() + 1  # a tie: the first wins
    x[2, 30000], x[2, 20] = float("nan"), float("nan")
    x[3] = float("-inf")
    x[4, 49152] = float("inf")
    x[5] = torch.randint(0, 3, (49153,), generator=g).to(dtype)  # many ties
    assert torch.equal(cpu_kernels.argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(cpu_kernels.argmax_rows(x[:, :1000]), x[:, :1000].argmax(dim=-1))  # strided rows

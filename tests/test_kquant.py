"""GGUF K-quants (Q4_K, Q5_K, Q6_K) kept in their blocks: the dequantizer bit-exact with
gguf's, the integer kernels against integer and float64 references on the same quantized
values on every kernel path this CPU has, and a tiny K-quantized llama run that way."""

import os

import numpy as np
import pytest
import torch

from lane import platform
from lane.model_executor.layers import cpu_kernels
from lane.model_executor.layers.linear import quant_rows

from conftest import check_kernels_on, narrower_isas, rel_to_terms, teacher_forced_logits

BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}  # per super-block of 256 weights
QMAX = {"Q4_K": 15, "Q5_K": 31}


# -- the formats, in numpy: a simple quantizer (gguf-py has none for K-quants) and an unpacker --

def _pack_k4_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins per super-block -> ggml's 12 bytes."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    for j in range(4):
        out[:, j] = (sc[:, j] & 63) | ((sc[:, j + 4] >> 4) << 6)
        out[:, j + 4] = (m[:, j] & 63) | ((m[:, j + 4] >> 4) << 6)
        out[:, j + 8] = (sc[:, j + 4] & 15) | ((m[:, j + 4] & 15) << 4)
    return out


def pack(kind: str, u: np.ndarray, sc: np.ndarray, m: np.ndarray, d: np.ndarray, dmin: np.ndarray) -> np.ndarray:
    """Super-blocks from their parts: u [B, 256] stored (unsigned) quants, sc / m [B, 8] six-bit
    scales / mins (Q6_K: sc [B, 16] int8, m unused), d / dmin [B] fp16 -> uint8 [B, bytes]."""
    B = u.shape[0]
    u = u.astype(np.uint8)
    d16 = d.astype(np.float16).view(np.uint8).reshape(B, 2)
    if kind == "Q6_K":
        ql = np.zeros((B, 128), np.uint8)
        qh = np.zeros((B, 64), np.uint8)
        for h in range(2):
            v = u[:, 128 * h:128 * h + 128].reshape(B, 4, 32)
            ql[:, 64 * h:64 * h + 32] = (v[:, 0] & 15) | ((v[:, 2] & 15) << 4)
            ql[:, 64 * h + 32:64 * h + 64] = (v[:, 1] & 15) | ((v[:, 3] & 15) << 4)
            qh[:, 32 * h:32 * h + 32] = sum(((v[:, k] >> 4) & 3) << (2 * k) for k in range(4))
        return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), d16], axis=1)
    v = u.reshape(B, 4, 2, 32)
    qs = ((v[:, :, 0] & 15) | ((v[:, :, 1] & 15) << 4)).reshape(B, 128)
    parts = [d16, dmin.astype(np.float16).view(np.uint8).reshape(B, 2), _pack_k4_scales(sc, m)]
    if kind == "Q5_K":
        parts.append(sum(((u.reshape(B, 8, 32)[:, c] >> 4) & 1) << c for c in range(8)).astype(np.uint8))
    return np.concatenate(parts + [qs], axis=1)


def quantize(kind: str, x: np.ndarray) -> np.ndarray:
    """float [N, K] (K a multiple of 256) -> K-quant blocks uint8 [N, K / 256 * bytes]:
    a plain min/max (Q6_K: absmax) quantizer, not ggml's search, but valid blocks."""
    N, K = x.shape
    xb = x.reshape(-1, 256).astype(np.float32)
    B = xb.shape[0]
    if kind == "Q6_K":
        sub = xb.reshape(B, 16, 16)
        amax = np.abs(sub).max(-1)
        d = (amax.max(-1) / 31 / 127).astype(np.float16).astype(np.float32)
        sc = np.clip(np.round(amax / 31 / np.where(d > 0, d, 1)[:, None]), 1, 127)
        step = (d[:, None] * sc)[..., None]
        q = np.clip(np.round(sub / np.where(step > 0, step, 1)), -32, 31)
        return pack(kind, (q + 32).reshape(B, 256), sc, None, d, None).reshape(N, -1)
    sub = xb.reshape(B, 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    scale, mins = (sub.max(-1) - lo) / QMAX[kind], -lo
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (mins.max(-1) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.round(mins / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63).astype(np.uint8)
    step = (d[:, None] * sc)[..., None]
    q = np.clip(np.round((sub + (dmin[:, None] * m)[..., None]) / np.where(step > 0, step, 1)), 0, QMAX[kind])
    return pack(kind, q.reshape(B, 256), sc, m, d, dmin).reshape(N, -1)


def unpack(kind: str, blocks: np.ndarray):
    """K-quant blocks [B, bytes] -> (signed quants q [B, 256], scales [B, S], mins [B, S],
    d, dmin [B]) per sub-block (S = 8 of 32 values; Q6_K: 16 of 16, mins 0), as ggml defines them."""
    b = blocks.reshape(-1, BYTES[kind])
    B = b.shape[0]
    if kind == "Q6_K":
        ql, qh = b[:, :128].astype(np.int64), b[:, 128:192].astype(np.int64)
        q = np.zeros((B, 256), np.int64)
        for h in range(2):
            for k in range(4):
                lo = (ql[:, 64 * h + 32 * (k & 1):64 * h + 32 * (k & 1) + 32] >> (4 * (k >> 1))) & 15
                q[:, 128 * h + 32 * k:128 * h + 32 * k + 32] = lo | (((qh[:, 32 * h:32 * h + 32] >> (2 * k)) & 3) << 4)
        sc = b[:, 192:208].view(np.int8).astype(np.int64)
        d = b[:, 208:210].copy().view(np.float16).astype(np.float32)[:, 0]
        return q - 32, sc, np.zeros_like(sc), d, np.zeros_like(d)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
    s = b[:, 4:16].astype(np.int64)
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    qs = b[:, -128:].astype(np.int64).reshape(B, 4, 1, 32) >> np.array([0, 4]).reshape(1, 1, 2, 1)
    q = (qs & 15).reshape(B, 256)
    if kind == "Q5_K":
        qh = b[:, 16:48].astype(np.int64).reshape(B, 1, 32) >> np.arange(8).reshape(1, 8, 1)
        q = q | ((qh & 1) << 4).reshape(B, 256)
    return q, sc, m, d, dmin


def random_blocks(kind: str, N: int, K: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes (every scale and quant bit pattern), with fp16 d / dmin of a sane size."""
    b = rng.integers(0, 256, (N * K // 256, BYTES[kind]), dtype=np.uint8)
    d = (rng.random(b.shape[0]) * 2e-3 + 1e-4).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if kind == "Q6_K":
        b[:, 208:210] = d
    else:
        b[:, 0:2] = d
        b[:, 2:4] = (rng.random(b.shape[0]) * 2e-3 + 1e-4).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(N, -1)


# -- the quantizer and the dequantizer ------------------------------------------------------

@pytest.mark.parametrize("kind", list(BYTES))
def test_quantizer_makes_valid_blocks(kind):
    import gguf

    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 512)).astype(np.float32)
    blocks = quantize(kind, x)
    assert blocks.shape == (8, 2 * BYTES[kind])
    back = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]).reshape(x.shape)
    err = np.abs(back - x).max() / np.abs(x).max()
    assert err < {"Q4_K": 0.1, "Q5_K": 0.05, "Q6_K": 0.025}[kind], err
    # the unpacker (the kernels' reference) reads the blocks as gguf does, float32 for float32
    q, sc, m, d, dmin = unpack(kind, blocks)
    S = sc.shape[1]
    w = ((d[:, None] * sc.astype(np.float32))[..., None] * q.reshape(-1, S, 256 // S).astype(np.float32)
         - (dmin[:, None] * m.astype(np.float32))[..., None])
    assert np.array_equal(w.reshape(x.shape), back)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", list(BYTES))
def test_dequant_kernel_is_gguf_rounded_once(kind, dtype):
    import gguf

    assert cpu_kernels.build()
    blocks = random_blocks(kind, 7, 768, np.random.default_rng(1))
    ref = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind]).reshape(-1).copy())
    out = cpu_kernels.dequant_ggml(blocks, kind, dtype)
    assert torch.equal(out, ref.to(dtype))


# -- the integer kernels -----------------------------------------------------------------

def check_kernels(shapes=((37, 256), (5, 768))) -> dict:
    """Every K kind, M = 1..16: the activations quantized as Q8_K, the int32 sub-block dots
    equal the integer reference exactly, the outputs within 1e-6 relative of float64 on the
    same quantized weights and activations."""
    assert cpu_kernels.build()
    rng = np.random.default_rng(0)
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for kind in BYTES:
        for N, K in shapes:
            blocks = random_blocks(kind, N, K, rng)
            q, sc, m, d, dmin = unpack(kind, blocks)
            S = sc.shape[1]  # sub-blocks per super-block
            L = 256 // S
            qw = torch.from_numpy(q).view(N, -1, L)  # [N, sub-blocks, L]
            ws = torch.from_numpy(d[:, None] * sc).double().view(N, -1)  # d * sc per sub-block
            wm = torch.from_numpy(dmin[:, None] * m).double().view(N, -1)  # dmin * m per sub-block
            wt = torch.from_numpy(blocks)
            for M in range(1, 17):
                x = torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 4
                qx, dx, bsum = cpu_kernels.quantize_rows_q8k(x)
                xb = x.view(M, -1, 256)
                assert torch.allclose(dx, xb.abs().amax(-1) / 127)
                assert (qx.view(M, -1, 256).long() - torch.round(xb / dx[..., None]).long()).abs().max() <= 1
                assert torch.equal(bsum.long(), qx.view(M, -1, 16).long().sum(-1))
                dots = torch.einsum("mbi,nbi->mnb", qx.view(M, -1, L).long(), qw)
                assert torch.equal(cpu_kernels.quant_block_dots(qx, wt, kind, N).long(), dots), (kind, M)
                dxs = dx.double().repeat_interleave(S, dim=1)  # d_x per sub-block
                xsum = qx.view(M, -1, L).double().sum(-1)
                terms = (ws[None] * dxs[:, None] * dots.double()
                         - wm[None] * (dxs * xsum)[:, None])  # [M, N, sub-blocks]
                rel = rel_to_terms(cpu_kernels.quant_linear(x, wt, kind, N), terms)
                worst = max(worst, rel)
                assert rel < 1e-6, (kind, N, K, M, rel)
    # The K-quants repacked 8 rows interleaved where their kernel runs (AVX-512 VNNI): the same
    # weights back, and each sub-block (32 values; Q6_K: 16) summed exactly against 8-bit blocks
    # of 32 activations (d_x per 32), then scaled (Q4_K, Q5_K: less its minimum times the sum)
    x8 = [k for k in BYTES if k in cpu_kernels.x8_kinds()]
    N, K = 16, 512
    for kind in BYTES:
        blocks = random_blocks(kind, N, K, rng)
        packed = cpu_kernels.repack_x8(torch.from_numpy(blocks), kind, N)
        assert (packed is not None) == (kind in x8)
        if packed is None:
            continue
        dense = cpu_kernels.dequant_ggml(blocks, kind, torch.float32).view(N, K)
        assert torch.equal(cpu_kernels.dequant_x8(packed, kind, N, K, torch.float32), dense)
        ids = torch.tensor([5, 0, 15, 5])  # a tied embedding's lookup in the LM head's blocks
        assert torch.equal(cpu_kernels.dequant_x8_rows(packed, kind, ids, K, torch.float32), dense[ids])
        q, sc, m, d, dmin = unpack(kind, blocks)
        L = 256 // sc.shape[1]
        qw = torch.from_numpy(q).view(N, -1, L)
        ws = torch.from_numpy(d[:, None] * sc).double().view(N, -1)
        wm = torch.from_numpy(dmin[:, None] * m).double().view(N, -1)
        for M in [*range(1, 18), 33, 64]:  # past the 16 rows of a pass, into a second and a third
            x = torch.randn(M, K, generator=g) * torch.rand(M, 1, generator=g) * 4
            qx, dx, sx = cpu_kernels.quantize_rows_q8(x)
            dots = torch.einsum("mbi,nbi->mnb", qx.view(M, -1, L).long(), qw)
            dxs = dx.double().repeat_interleave(32 // L, dim=1)
            xsum = dxs * qx.view(M, -1, L).double().sum(-1)
            terms = torch.stack((ws[None] * dxs[:, None] * dots.double(), -wm[None] * xsum[:, None]), dim=-1)
            rel = rel_to_terms(cpu_kernels.quant_linear(x, packed, kind, N, x8=True), terms.view(M, N, -1))
            worst = max(worst, rel)
            assert rel < 1e-6, (kind, "x8", M, rel)
    return {"isa": cpu_kernels.isa(), "worst": worst, "x8": x8}


def test_kernels_on_this_path():
    res = check_kernels()
    vnni = cpu_kernels.isa() == "avx512" and "avx512_vnni" in platform.cpu_flags()
    assert res["x8"] == (list(BYTES) if vnni and os.environ.get("LANE_CPU_VNNI") != "0" else [])


def _paths():
    paths = [(i, "1") for i in narrower_isas()]
    if platform.native_cpu_isa() == "avx512" and "avx512_vnni" in platform.cpu_flags():
        paths.append(("avx512", "0"))  # AVX-512 without its VNNI rows
    return paths


@pytest.mark.parametrize("isa,vnni", _paths())
def test_kernels_on_other_paths(isa, vnni):
    """The generic and AVX2 builds, and AVX-512 without VNNI, on this CPU."""
    assert not check_kernels_on("test_kquant", isa, LANE_CPU_VNNI=vnni)["x8"]  # the K-quants keep their kernel


# -- end to end: a tiny K-quantized llama ----------------------------------------------------

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2
# Q4_K_M-like: Q4_K mostly, Q6_K for the embedding, output and layer 0's attn_v (so its fused
# qkv mixes kinds: a kernel per kind), Q5_K / Q6_K ffn_down
KINDS = {"token_embd": "Q6_K", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": ("Q6_K", "Q4_K"),
         "attn_output": "Q5_K", "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": ("Q5_K", "Q6_K")}


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory) -> str:
    import gguf
    from tokenizers import pre_tokenizers

    tokens = ["<s>", "</s>"] + sorted(pre_tokenizers.ByteLevel.alphabet())  # byte-level, no merges
    rng = np.random.default_rng(0)
    path = str(tmp_path_factory.mktemp("kquant") / "tiny-kquant.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(LAYERS)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_context_length(512)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    hd = HIDDEN // HEADS

    def add(name: str, rows: int, cols: int, kind: str, std: float) -> None:
        x = rng.standard_normal((rows, cols)).astype(np.float32) * std
        w.add_tensor(name, quantize(kind, x), raw_dtype=gguf.GGMLQuantizationType[kind])

    add("token_embd.weight", len(tokens), HIDDEN, KINDS["token_embd"], 1.0)
    add("output.weight", len(tokens), HIDDEN, KINDS["output"], 1.0)  # peaked logits: greedy is stable
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * hd, HIDDEN), "attn_v": (KV_HEADS * hd, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
              "ffn_down": (HIDDEN, FFN)}
    for i in range(LAYERS):
        for part, (rows, cols) in shapes.items():
            kind = KINDS[part] if isinstance(KINDS[part], str) else KINDS[part][i]
            add(f"blk.{i}.{part}.weight", rows, cols, kind, cols ** -0.5)  # gain 1
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_tiny_kquant_llama_auto_matches_dequantized(kquant_gguf):
    from lane import LLM, SamplingParams

    args = dict(dtype="float32", show_progress=False, max_model_len=256, kv_cache_memory_bytes=16 << 20, threads=1)
    q, dense = LLM(kquant_gguf, quantization="auto", **args), LLM(kquant_gguf, quantization="none", **args)
    m = q.engine.worker.model
    assert m.model.embed_tokens.qkind == "Q6_K" and m.lm_head.qkind == "Q6_K"
    layers = m.model.layers
    qkv = layers[0].self_attn.qkv_proj  # q, k in Q4_K and v in Q6_K: each kind keeps its blocks
    assert qkv.qkind == "Q4_K+Q6_K" and qkv.qweight is None and qkv.weight is None
    assert [(p.start, p.kind, p.blocks.shape[0]) for p in qkv.qparts] == [
        (0, "Q4_K", HIDDEN + KV_HEADS * (HIDDEN // HEADS)), (HIDDEN + KV_HEADS * (HIDDEN // HEADS), "Q6_K",
                                                              KV_HEADS * (HIDDEN // HEADS))]
    assert layers[1].self_attn.qkv_proj.qkind == "Q4_K" and layers[1].self_attn.qkv_proj.weight is None
    assert [layer.mlp.down_proj.qkind for layer in layers] == ["Q5_K", "Q6_K"]
    assert layers[0].self_attn.o_proj.qkind == "Q5_K" and layers[0].mlp.gate_up_proj.qkind == "Q4_K"
    ids = list(np.random.default_rng(1).integers(2, 258, 40))
    ref = teacher_forced_logits(dense, ids, 40)
    for chunk in (1, 7, 16, 40):  # GEMV, small-M GEMM, and prefill (dequantized per call)
        got = teacher_forced_logits(q, ids, chunk)
        rel = float((got - ref).norm() / ref.norm())
        # the integer kernels' rows: 8-bit activations, one scale per 256 (as ggml's Q8_K): ~1.6% here
        assert rel < (1e-5 if chunk > quant_rows(torch.float32) else 0.03), (chunk, rel)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = {"prompt_token_ids": ids[:8]}
    a = q.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    b = dense.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert list(a) == list(b)

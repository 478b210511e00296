"""GGUF weights kept in their blocks (--quantization auto): the integer kernels against
integer and float64 references on the same quantized values, on every kernel path this
CPU has; and the embedded SmolLM2 run that way (memory, perplexity)."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lane import platform
from lane.model_executor.layers import cpu_kernels

from conftest import check_kernels_on, narrower_isas, rel_to_terms, teacher_forced_logits
from lane.bench.quality import perplexity

KINDS = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # bytes per 32 weights


def random_blocks(kind: str, N: int, K: int, g: torch.Generator) -> torch.Tensor:
    """Random GGUF blocks: random quants, fp16 scales (and Q4_1 minimums) of a sane size."""
    nb = K // 32
    blocks = torch.randint(0, 256, (N, nb, KINDS[kind]), generator=g, dtype=torch.int32).to(torch.uint8)
    scale = (torch.rand(N, nb, 1, generator=g) * 0.02 + 0.001).half().view(torch.uint8)
    blocks[..., 0:2] = scale.view(N, nb, 2)
    if kind == "Q4_1":
        blocks[..., 2:4] = (torch.randn(N, nb, 1, generator=g) * 0.05).half().view(torch.uint8).view(N, nb, 2)
    return blocks.view(N, -1).contiguous()


def unpack_reference(kind: str, blocks: torch.Tensor, K: int):
    """(integer quants [N, K], scales d [N, K/32], minimums m [N, K/32]) as the formats define them."""
    N, nb = blocks.shape[0], K // 32
    b = blocks.view(N, nb, KINDS[kind])
    d = b[..., 0:2].contiguous().view(torch.float16).float().view(N, nb)
    m = torch.zeros(N, nb)
    if kind == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).long()
    else:
        raw = b[..., 2 if kind == "Q4_0" else 4:].long()
        q = torch.cat((raw & 0x0F, raw >> 4), dim=-1)
        if kind == "Q4_0":
            q = q - 8
        else:
            m = b[..., 2:4].contiguous().view(torch.float16).float().view(N, nb)
    return q.reshape(N, K), d, m


def check_kernels(shapes=((37, 96), (64, 576))) -> dict:
    """Every kind, M = 1..16: int32 block dots equal the integer reference exactly; outputs
    within 1e-6 relative of float64 on the same quantized weights and activations. With N a
    multiple of 8, also in the repacked x8 layout, which dequantizes to the same values."""
    assert cpu_kernels.build()
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for kind in KINDS:
        for N, K in shapes:
            blocks = random_blocks(kind, N, K, g)
            qw, dw, mw = unpack_reference(kind, blocks, K)
            x8 = cpu_kernels.repack_x8(blocks, kind, N)
            assert (x8 is not None) == (N % 8 == 0)
            if x8 is not None:
                assert torch.equal(cpu_kernels.dequant_x8(x8, kind, N, K, torch.float32).view(-1),
                                   cpu_kernels.dequant_ggml(blocks.numpy(), kind, torch.float32))
            for M in list(range(1, 17)) + ([24, 64] if x8 is not None else []):  # x8 serves up to 64 rows
                x = torch.randn(M, K, generator=g)
                qx, dx, sx = cpu_kernels.quantize_rows_q8(x)
                # the activation quantization: d = max|x| / 127 per block, q = round(x / d)
                xb = x.view(M, -1, 32)
                assert torch.allclose(dx, xb.abs().amax(-1) / 127)
                assert (qx.view(M, -1, 32).long() - torch.round(xb / dx[..., None]).long()).abs().max() <= 1
                assert torch.allclose(sx, dx * qx.view(M, -1, 32).float().sum(-1))
                dots = torch.einsum("mbi,nbi->mnb", qx.view(M, -1, 32).long(), qw.view(N, -1, 32))
                assert torch.equal(cpu_kernels.quant_block_dots(qx, blocks, kind, N).long(), dots), (kind, M)
                # [M, N, 2 x blocks]: each block's scale and (Q4_1) minimum parts, the products the
                # kernels compute, so a block whose two parts cancel is held to their size
                terms = torch.cat((dw.double()[None] * dx.double()[:, None] * dots.double(),
                                   (mw.double()[None] * sx.double()[:, None]).expand(M, N, -1)), dim=-1)
                rel = rel_to_terms(cpu_kernels.quant_linear(x, blocks, kind, N), terms)
                worst = max(worst, rel)
                assert rel < 1e-6, (kind, N, K, M, rel)
                if x8 is not None:
                    assert torch.equal(cpu_kernels.quant_x8_block_dots(qx, x8, kind, N).long(), dots), (kind, M)
                    rel = rel_to_terms(cpu_kernels.quant_linear(x, x8, kind, N, x8=True), terms)
                    worst = max(worst, rel)
                    assert rel < 1e-6, ("x8", kind, N, K, M, rel)
                # half-precision rows: the same fp32 sums, rounded once to the row's dtype (to
                # nearest even: exact on the vector paths; the generic build's compiler may sum
                # the float and half instances in different orders, so there within an ulp)
                for dt in (torch.bfloat16, torch.float16):
                    xh = x.to(dt)
                    for w, packed in ((blocks, False), (x8, True)) if x8 is not None else ((blocks, False),):
                        # (int8: the integer kernels for bf16 rows too, where the dequantizing
                        # tiles would take them: test_x8_bf16_tiles_...)
                        y = cpu_kernels.quant_linear(xh, w, kind, N, x8=packed, int8=True)
                        ref = cpu_kernels.quant_linear(xh.float(), w, kind, N, x8=packed).to(dt)
                        assert y.dtype == dt
                        if cpu_kernels.isa() != "generic":
                            assert torch.equal(y, ref), (kind, N, K, M, dt, packed)
                        else:
                            r32 = ref.float()
                            tol = torch.finfo(dt).eps * r32.abs() + 1e-6 * r32.abs().max()  # (cancellation)
                            assert ((y.float() - r32).abs() <= tol).all(), (kind, N, K, M, dt, packed)
    return {"isa": cpu_kernels.isa(), "worst": worst}


def test_kernels_on_this_path():
    check_kernels()


@pytest.mark.parametrize("isa", narrower_isas())
def test_kernels_on_narrower_paths(isa):
    """The generic and AVX2 builds, on this CPU (LANE_CPU_ISA caps the build)."""
    check_kernels_on("test_quant_linear", isa)


@pytest.mark.skipif(not (platform.native_cpu_isa() == "avx512" and "avx512_vnni" in platform.cpu_flags()),
                    reason="no AVX-512 VNNI here: the x8 kernel's maddubs path is this CPU's own")
def test_x8_maddubs_path_on_a_vnni_cpu():
    """An AVX-512 build on a VNNI CPU runs the x8 dots with dpbusd; LANE_CPU_VNNI=0 takes maddubs."""
    check_kernels_on("test_quant_linear", "avx512", LANE_CPU_VNNI="0")


def test_x8_amx_tiles_equal_the_pair_kernel():
    """Where the CPU has AMX-INT8, the x8 kernels run many rows on int8 tiles: every kind's output,
    fp32 and bf16, with a bias, an odd group count (8 columns of a 16-column unit), an odd block
    count and rows not a multiple of the 16-row tile, equals the VNNI pair kernel's bit for bit
    (the kernel built by this machine's GCC: GCC 12 drops a stack tile config that
    _tile_loadconfig is given)."""
    assert cpu_kernels.build()
    if not cpu_kernels.x8_amx()[0]:
        pytest.skip("no AMX-INT8 here (or LANE_CPU_AMX=0): the pair kernel runs every row count")
    from test_kquant import random_blocks as kquant_blocks
    g = torch.Generator().manual_seed(3)
    rng = np.random.default_rng(3)
    _, min_rows = cpu_kernels.x8_amx()
    try:
        cpu_kernels.x8_amx(min_rows=1)
        for kind in set(cpu_kernels.x8_kinds()) - {"Q6_K"}:  # (Q6_K stays on the pair kernel)
            # (an odd count of 32-value blocks too: the activation tiles go two blocks at a time)
            for N, K in ((40, 512), (16, 768)) + (() if kind in cpu_kernels.K_KINDS else ((24, 96),)):
                blocks = torch.from_numpy(kquant_blocks(kind, N, K, rng)) if kind in cpu_kernels.K_KINDS else \
                    random_blocks(kind, N, K, g)
                packed = cpu_kernels.repack_x8(blocks, kind, N)
                bias = torch.randn(N, generator=g)
                for M in (1, 16, 23, 130):
                    for dtype in (torch.float32, torch.bfloat16):
                        x = (torch.randn(M, K, generator=g) * 3).to(dtype)
                        cpu_kernels.x8_amx(True)  # (int8: bf16 rows too, not the dequantizing bf16 tiles)
                        tiles = cpu_kernels.quant_linear(x, packed, kind, N, bias, x8=True, int8=True)
                        cpu_kernels.x8_amx(False)
                        pairs = cpu_kernels.quant_linear(x, packed, kind, N, bias, x8=True, int8=True)
                        assert torch.equal(tiles, pairs), (kind, N, K, M, dtype)
    finally:
        cpu_kernels.x8_amx(True, min_rows)


def test_x8_gate_up_tiles_apply_silu_as_the_two_kernels_do():
    """Where the CPU has AMX-BF16, a gate_up layer's tiles apply the SiLU-and-mul as they store
    (the fused decode step's MLP): every value equals, bit for bit, the layer's output (the same
    tiles) run through silu_and_mul, with and without bias, for 1..266 rows (one input tile, a
    pair, rows in more than one block at K = 1536), and a row alone equals the same row in the
    batch; fp32 rows are not taken."""
    assert cpu_kernels.build()
    if not cpu_kernels.x8_bf16_amx():
        pytest.skip("no AMX-BF16 here (or LANE_CPU_AMX=0 / LANE_CPU_X8_BF16=0): gate_up and SiLU run apart")
    g = torch.Generator().manual_seed(11)
    for kind in ("Q4_0", "Q4_1"):
        for inter, K in ((48, 96), (1536, 576), (32, 1536)):
            packed = cpu_kernels.repack_x8(random_blocks(kind, 2 * inter, K, g), kind, 2 * inter)
            x = (torch.randn(266, K, generator=g) * 4).to(torch.bfloat16)
            for bias in (None, torch.randn(2 * inter, generator=g)):
                act = cpu_kernels.x8_silu_mul(x, packed, kind, inter, bias)
                gate_up = cpu_kernels.quant_linear(x, packed, kind, 2 * inter, bias, x8=True)
                assert torch.equal(act, cpu_kernels.silu_and_mul(gate_up)), (kind, inter, K)
                ref = F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()
                torch.testing.assert_close(act.float(), ref, atol=0.05, rtol=1e-2)
                for m, n in ((0, 1), (3, 16), (17, 17), (40, 33)):
                    assert torch.equal(cpu_kernels.x8_silu_mul(x[m:m + n], packed, kind, inter, bias), act[m:m + n])
    assert cpu_kernels.x8_silu_mul(x.float(), packed, kind, inter) is None


def test_x8_bf16_tiles_are_the_dense_tiles_on_the_dequantized_weight():
    """Where the CPU has AMX-BF16, bf16 rows on x8 Q4_0 / Q4_1 blocks run on bf16 tiles, each unit
    of weight rows dequantized per call: every output equals, bit for bit, the dense bf16 tiles'
    on the weight dequantized to bf16 (d q + m in fp32, rounded once) with the same bias, for one
    row, a tile, a tile and one, and many (both unit shapes, the K chunks, rows in more than one
    block); a row alone equals the same row in any batch; N not a multiple of 16 (a unit's last
    tile half empty) stays within bf16 rounding of fp32; the int8 kernels still run fp32 rows, and
    the bf16 rows of a layer that asks for them (quant_linear's int8: MoE experts)."""
    assert cpu_kernels.build()
    if not cpu_kernels.x8_bf16_amx():
        pytest.skip("no AMX-BF16 here (or LANE_CPU_AMX=0 / LANE_CPU_X8_BF16=0): the int8 kernels run bf16 rows")
    g = torch.Generator().manual_seed(5)
    for kind in ("Q4_0", "Q4_1"):
        # (units of 48 and 32 rows with tails; K of 3, 18 and 48 steps: one chunk, a partial last, several)
        for N, K in ((96, 96), (160, 576), (48, 1536), (40, 512), (24, 256)):
            blocks = random_blocks(kind, N, K, g)
            packed = cpu_kernels.repack_x8(blocks, kind, N)
            w = cpu_kernels.dequant_x8(packed, kind, N, K, torch.float32).to(torch.bfloat16)
            bias = torch.randn(N, generator=g).to(torch.bfloat16)
            # (266 rows: K = 1536 takes them in blocks of 256, bf16_amx.cpp's kBlockBytes, the last of 10)
            x = (torch.randn(266, K, generator=g) * 2).to(torch.bfloat16)
            y = cpu_kernels.quant_linear(x, packed, kind, N, bias.float(), x8=True)
            assert y.dtype == torch.bfloat16
            if N % 16 == 0:
                assert torch.equal(y, cpu_kernels.small_m_linear(x, w, bias)), (kind, N, K)
            ref = x.float() @ w.float().T + bias.float()
            torch.testing.assert_close(y.float(), ref, atol=0.05, rtol=1e-2)
            for M in (1, 15, 16, 17, 33):
                assert torch.equal(cpu_kernels.quant_linear(x[:M], packed, kind, N, bias.float(), x8=True), y[:M])
                assert torch.equal(cpu_kernels.quant_linear(x[M:M + 1], packed, kind, N, bias.float(), x8=True),
                                   y[M:M + 1]), (kind, N, K, M)
            # fp32 rows: the int8 kernel's 8-bit activations, not these tiles
            yf = cpu_kernels.quant_linear(x[:3].float(), packed, kind, N, bias.float(), x8=True)
            assert not torch.equal(yf.to(torch.bfloat16), y[:3])
            # a layer that asks for the int8 kernels (an MoE expert's) gets them with the tiles on
            try:
                cpu_kernels.x8_bf16_amx(False)
                int8 = cpu_kernels.quant_linear(x[:5], packed, kind, N, bias.float(), x8=True)
            finally:
                cpu_kernels.x8_bf16_amx(True)
            assert torch.equal(cpu_kernels.quant_linear(x[:5], packed, kind, N, bias.float(), x8=True, int8=True), int8)
            assert not torch.equal(int8, y[:5])


def test_smollm_quantized_memory_and_perplexity(smollm_gguf):
    from lane import LLM, SamplingParams
    from lane.model_executor.loader import resident_weight_bytes
    from lane.transformers_utils.gguf_file import open_gguf

    file_bytes = sum(t.data.nbytes for t in open_gguf(smollm_gguf).tensors)
    args = dict(dtype="float32", show_progress=False, max_model_len=2048, kv_cache_memory_bytes=256 << 20)
    q = LLM(smollm_gguf, quantization="auto", **args)
    dense = LLM(smollm_gguf, quantization="none", **args)
    assert resident_weight_bytes(q.engine.worker.model) <= 1.15 * file_bytes
    from lane.entrypoints.explain import explain
    for llm, how in ((q, "auto"), (dense, "none")):  # explain's figure, before loading, is the loaded one
        mib = resident_weight_bytes(llm.engine.worker.model) / 2**20
        assert f"weights resident: {mib:,.1f} MiB" in explain(smollm_gguf, "float32", quantization=how)
    assert resident_weight_bytes(dense.engine.worker.model) > 4 * file_bytes
    layers = q.engine.worker.model.model.layers
    assert layers[0].self_attn.qkv_proj.qkind == "Q4_1" and layers[0].self_attn.qkv_proj.weight is None
    assert q.engine.worker.model.lm_head.qweight is q.engine.worker.model.model.embed_tokens.qweight  # tied
    readme = os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")
    ids = q.get_tokenizer().encode(open(readme).read())[:1024]
    p_q, p_dense = perplexity(q, ids), perplexity(dense, ids)
    assert abs(p_q / p_dense - 1) < 0.01, (p_q, p_dense)
    out = q.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text


def fake_quantize_int8(llm) -> None:
    """The dense model's int8 targets replaced in place by their int8 values times the scales:
    the model that --quantization int8 computes exactly (up to float rounding)."""
    from lane.model_executor.layers.fused_moe import FusedMoE
    from lane.model_executor.loader import int8_targets

    def fake(w: torch.Tensor) -> None:
        qw, sw = cpu_kernels.quantize_weight_int8(w)
        w.copy_(qw.float() * sw[:, None])

    with torch.no_grad():
        for m in int8_targets(llm.engine.worker.model):
            for w in ([*m.w13, *m.w2] if isinstance(m, FusedMoE) else [m.weight]):
                fake(w)


@pytest.mark.parametrize("quantization", ["int8", "w8a8"])
@pytest.mark.parametrize("arch", ["llama", "deepseek_v3", "deepseek_v4"])
def test_int8_checkpoints(tmp_path, arch, quantization):
    """--quantization int8 / w8a8 on a safetensors checkpoint (dense layers and MoE experts): the
    linear weights become int8 per channel; weights read as matrices, the LM heads and the MTP
    layer stay dense. W8A16 computes exactly the model whose weights are their int8 values times
    the scales; W8A8 adds per-token activation rounding; on tiny llama both track the float model."""
    from lane import LLM
    from lane.entrypoints.explain import explain
    from lane.entrypoints.tiny_model import write_tiny_model
    from lane.model_executor.layers.fused_moe import FusedMoE
    from lane.model_executor.layers.linear import Linear
    from lane.model_executor.loader import int8_targets, resident_weight_bytes

    d = write_tiny_model(arch, str(tmp_path / arch))
    args = dict(dtype="float32", show_progress=False, kv_cache_memory_bytes=32 << 20, max_model_len=256)
    dense, fake, q = (LLM(d, quantization="none", **args), LLM(d, quantization="none", **args),
                      LLM(d, quantization=quantization, **args))
    model = q.engine.worker.model
    targets = int8_targets(model)
    assert targets and all(m.qkind == quantization for m in targets)
    assert all(m.weight is None and m.qweight.dtype == torch.int8 for m in targets if isinstance(m, Linear))
    assert all(m.w13 is None and m.qw13.dtype == torch.int8 for m in targets if isinstance(m, FusedMoE))
    assert any(isinstance(m, FusedMoE) for m in targets) == arch.startswith("deepseek")
    kept = [m for m in model.modules() if isinstance(m, Linear) and m not in targets]
    assert kept and all(m.qkind is None and m.weight is not None for m in kept)  # heads, kv_b_proj, wo_a, mtp
    resident = resident_weight_bytes(model)
    assert resident < resident_weight_bytes(dense.engine.worker.model)
    assert f"weights resident: {resident / 2**20:,.1f} MiB" in explain(d, "float32", quantization=quantization)
    fake_quantize_int8(fake)
    ids = q.get_tokenizer().encode("The quick brown fox jumps over the lazy dog. " * 6)[:64]
    got, ref, ref_fake = (teacher_forced_logits(llm, ids) for llm in (q, dense, fake))
    rel_fake = float((got - ref_fake).norm() / ref_fake.norm())
    # W8A8's activation rounding (exact per layer: test_int8_linear.py) grows through the tiny
    # DeepSeeks' random layers to ~20%; garbage would be ~100%
    assert rel_fake < (1e-4 if quantization == "int8" else 0.05 if arch == "llama" else 0.3), rel_fake
    if arch == "llama":  # (the tiny DeepSeeks' random weights amplify any rounding, int8's too)
        assert float((got - ref).norm() / ref.norm()) < 0.1
        assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.85


def test_int8_on_a_gguf_is_refused_by_name(smollm_gguf):
    from lane import LLM

    with pytest.raises(ValueError, match="--quantization int8 is for safetensors checkpoints"):
        LLM(smollm_gguf, quantization="int8", show_progress=False)


def test_bad_quantization_is_refused():
    from lane import LLM

    with pytest.raises(ValueError, match="--quantization 'int4' is not one of auto, none"):
        LLM(quantization="int4", show_progress=False)
    r = subprocess.run([sys.executable, "-m", "lane.entrypoints.cli", "generate", "hi", "--quantization", "int4"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--quantization" in r.stderr and "Traceback" not in r.stderr

"""int8 linear kernels (--quantization int8 = W8A16, w8a8 = W8A8 dynamic per-token): the
quantizers' definitions, the int32 dot products exactly equal to an integer reference, and
outputs within 1e-6 (relative to the sum of |terms|) of float64 on the same quantized weights
and activations, for M = 1..16 (the kernels) and 17, 64 (torch's GEMMs), on every kernel
path this CPU has and on the torch-only fallback."""

import pytest
import torch

from lane.model_executor.layers import cpu_kernels

from conftest import check_kernels_on, narrower_isas

SHAPES = ((37, 100), (64, 576), (5, 7))  # N, K: neither a multiple of 32 / 64, and one that is
ROWS = list(range(1, 17)) + [17, 64]


def check_quantizers(g: torch.Generator) -> None:
    w = torch.randn(9, 50, generator=g)
    w[3] = 0
    qw, sw = cpu_kernels.quantize_weight_int8(w, rows=4)  # several chunks
    assert qw.dtype == torch.int8 and sw.dtype == torch.float32 and qw.is_contiguous()
    assert torch.equal(sw, w.abs().amax(1) / 127) and sw[3] == 0 and not qw[3].any()
    nz = sw > 0
    assert torch.equal(qw[nz].float(), torch.round(w[nz] / sw[nz, None]))
    assert torch.equal(qw.abs().amax(1)[nz], torch.full((8,), 127, dtype=torch.int8))
    assert torch.equal(cpu_kernels.int8_weight_sums(qw), qw.long().sum(1).int())
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = (torch.randn(6, 70, generator=g) * 3).to(dtype)
        x[2] = 0
        qx, sx = cpu_kernels.quantize_per_token_int8(x)
        assert qx.dtype == torch.int8 and sx.dtype == torch.float32
        xf = x.float()
        assert torch.allclose(sx, xf.abs().amax(1) / 127, rtol=1e-6, atol=0) and sx[2] == 0 and not qx[2].any()
        assert int(qx.abs().max()) == 127
        ref = torch.round(xf / torch.where(sx > 0, sx, 1)[:, None])
        assert (qx.float() - ref).abs().max() <= 1  # x * (127 / max) may round a tie the other way


def within(y: torch.Tensor, ref: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> float:
    """The worst |y - ref| / scale, where bf16 outputs may be off by a bf16 ulp of ref (the
    output's rounding) and of ref - b (the bf16 GEMM's, before the scale and bias) beyond it."""
    err = (y.double() - ref).abs()
    if dtype == torch.bfloat16:
        err = (err - 2.0 ** -8 * 1.01 * (ref.abs() + (ref - b).abs())).clamp(min=0)
    return float((err / scale).max())


def check_kernels(shapes=SHAPES, rows=ROWS) -> dict:
    g = torch.Generator().manual_seed(0)
    check_quantizers(g)
    worst = 0.0
    for N, K in shapes:
        qw, sw = cpu_kernels.quantize_weight_int8(torch.randn(N, K, generator=g))
        wsum = cpu_kernels.int8_weight_sums(qw)
        wref = qw.double() * sw.double()[:, None]
        for M in rows:
            bias = torch.randn(N, generator=g) if M % 2 else None
            b = torch.zeros(N, dtype=torch.float64) if bias is None else bias.double()
            for dtype in (torch.float32, torch.bfloat16):
                x = torch.randn(M, K, generator=g).to(dtype)
                qx, sx = cpu_kernels.quantize_per_token_int8(x)
                dots = qx.long() @ qw.long().t()
                for ws in (wsum, None):  # VNNI (where the CPU has it) and maddubs / generic
                    got = cpu_kernels.int8_w8a8_dots(qx, qw, ws)
                    assert got.dtype == torch.int32 and torch.equal(got.long(), dots), (N, K, M, ws is None)
                # W8A8: y = sx * sw * dot + bias
                terms = sx.double()[:, None, None] * qx.double()[:, None, :] * wref[None]  # [M, N, K]
                scale = terms.abs().sum(-1) + b.abs() + 1e-30
                y = cpu_kernels.int8_linear_w8a8(x, qw, sw, bias, wsum)
                assert y.dtype == dtype and y.shape == (M, N)
                rel = within(y, terms.sum(-1) + b, b, scale, dtype)
                assert rel < 1e-6, ("w8a8", N, K, M, dtype, rel)
                worst = max(worst, rel)
                # W8A16: y = (x . qw^T) * sw + bias, x as it is
                terms = x.double()[:, None, :] * wref[None]
                scale = terms.abs().sum(-1) + b.abs() + 1e-30
                y = cpu_kernels.int8_linear_w8a16(x, qw, sw, bias)
                assert y.dtype == dtype and y.shape == (M, N)
                rel = within(y, terms.sum(-1) + b, b, scale, dtype)
                assert rel < 1e-6, ("w8a16", N, K, M, dtype, rel)
                worst = max(worst, rel)
    return {"isa": cpu_kernels.isa(), "worst": worst}


def test_kernels_on_this_path(monkeypatch):
    assert cpu_kernels.build()
    monkeypatch.setattr(cpu_kernels, "W8A8_SMALL_M", cpu_kernels.INT8_SMALL_M)  # the kernel for all M <= 16
    check_kernels()


def test_torch_fallback(monkeypatch):
    """Without the compiled kernels (no compiler) the same API runs on torch alone."""
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    check_kernels(shapes=((37, 100),), rows=(1, 5, 17))


@pytest.mark.parametrize("isa", narrower_isas())
def test_kernels_on_narrower_paths(isa):
    """The generic and AVX2 builds, on this CPU (LANE_CPU_ISA caps the build)."""
    check_kernels_on("test_int8_linear", isa)

"""The paged prefill attention kernel against a float64 reference of causal attention
with cached context: random caches, shuffled block tables, GQA, odd sizes, on every
kernel path this CPU has."""

import pytest
import torch

from lane.model_executor.layers import cpu_kernels

from conftest import check_kernels_on, narrower_isas


def reference(q, kc, vc, block_ids, num_computed, scale):
    """float64: query i attends to positions [0, num_computed + i] of the request."""
    n, H, D = q.shape
    total = num_computed + n
    k = kc[block_ids].double().transpose(1, 2).reshape(-1, kc.shape[1], D)[:total]  # [total, KVH, D]
    v = vc[block_ids].double().transpose(1, 2).reshape(-1, kc.shape[1], D)[:total]
    g = H // kc.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,thd->hnt", q.double(), k) * scale
    s.masked_fill_(torch.arange(total)[None, None, :] > torch.arange(num_computed, total)[None, :, None], float("-inf"))
    return torch.einsum("hnt,thd->nhd", torch.softmax(s, dim=-1), v)


# (KVH, G, D, block size, n, num_computed)
CASES = [(3, 3, 64, 16, 37, 0), (3, 3, 64, 16, 100, 75), (2, 4, 128, 16, 53, 141), (4, 1, 64, 16, 19, 0),
         (1, 4, 80, 16, 70, 33), (2, 3, 128, 32, 5, 300), (1, 1, 256, 16, 1, 17), (2, 2, 80, 8, 41, 9)]


def check_kernels() -> dict:
    assert cpu_kernels.build()
    g = torch.Generator().manual_seed(0)
    worst = {}
    for KVH, G, D, BS, n, nc in CASES:
        nblocks = -(-(nc + n) // BS)
        NB = nblocks + 5
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)):
            kc = torch.randn(NB, KVH, BS, D, generator=g).to(dtype)
            vc = torch.randn(NB, KVH, BS, D, generator=g).to(dtype)
            kc[0].fill_(float("nan"))  # a slot the request does not own must never be read
            vc[0].fill_(float("nan"))
            ids = (torch.randperm(NB - 1, generator=g) + 1)[:nblocks]  # shuffled, not contiguous
            # the last block's slots past the chunk hold garbage: never read either
            last, used = ids[-1], (nc + n) - (nblocks - 1) * BS
            kc[last, :, used:] = float("nan")
            vc[last, :, used:] = float("nan")
            q = (torch.randn(n, KVH * G, D, generator=g) * 2).to(dtype)
            scale = D ** -0.5
            out = cpu_kernels.prefill_attention(q, kc, vc, ids, nc, scale)
            ref = reference(q, kc, vc, ids, nc, scale)
            # relative to each output row's largest value (single elements can be near zero)
            err = float(((out.double() - ref).abs() / ref.abs().amax(-1, keepdim=True)).max())
            worst[str(dtype)] = max(worst.get(str(dtype), 0.0), err)
            assert err < tol, (KVH, G, D, BS, n, nc, dtype, err)
    return {"isa": cpu_kernels.isa(), "worst": worst}


def test_kernel_on_this_path():
    check_kernels()


@pytest.mark.parametrize("isa", narrower_isas())
def test_kernel_on_narrower_paths(isa):
    """The generic and AVX2 builds, on this CPU (LANE_CPU_ISA caps the build)."""
    check_kernels_on("test_prefill_attention", isa)


@pytest.mark.parametrize("nc", [0, 45])
def test_torch_path_agrees(nc):
    """The gather + SDPA path (other devices, LANE_PREFILL_ATTENTION=torch) gives the kernel's result."""
    from lane.model_executor.layers.attention import prefill_attention_torch

    assert cpu_kernels.build()
    g = torch.Generator().manual_seed(1)
    KVH, G, D, BS, n = 3, 3, 64, 16, 30
    nb = -(-(nc + n) // BS)
    kc, vc = torch.randn(nb + 2, KVH, BS, D, generator=g), torch.randn(nb + 2, KVH, BS, D, generator=g)
    ids = torch.randperm(nb + 1, generator=g)[:nb] + 1
    q = torch.randn(n, KVH * G, D, generator=g)
    k, v = (c[ids].transpose(1, 2).reshape(-1, KVH, D)[nc:nc + n] for c in (kc, vc))
    ref = reference(q, kc, vc, ids, nc, 0.125).float()
    torch.testing.assert_close(prefill_attention_torch(q, k, v, kc, vc, ids, nc, 0.125), ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cpu_kernels.prefill_attention(q, kc, vc, ids, nc, 0.125), ref, rtol=1e-4, atol=1e-5)

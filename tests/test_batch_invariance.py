"""Batch invariance, the default: a request's greedy tokens do not depend on the other
requests in its batch, on chunked prefill, on prefix-cache hits, on preemption and recompute,
or on the run, under --quantization auto and none, in bfloat16 and float32 (the embedded
SmolLM2). Exact token equality: a row of a prefill chunk is computed as the same row of a
decode step, bit for bit (cpu_kernels.BATCH_INVARIANT)."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from lane import LLM, SamplingParams
from lane.model_executor.layers import cpu_kernels

PREFIX = ("You are a careful assistant. Answer in one short paragraph, plainly, and do not repeat the "
          "question. Here is the question:")  # shared by all: later prompts hit its blocks
TOPICS = ["why the sky is blue", "how bees make honey", "what a compiler does", "why ice floats",
          "how a bicycle stays up", "what causes tides", "how vaccines work", "why cats purr",
          "what a black hole is", "how bread rises", "why leaves change colour", "how magnets work",
          "what rust is made of", "how a rainbow forms", "why we dream", "how a lock opens"]
PROMPTS = [f"{PREFIX} explain {t}." + " Please be brief." * (i % 4) for i, t in enumerate(TOPICS)]
SP = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
CONFIGS = [("auto", "bfloat16"), ("auto", "float32"), ("none", "bfloat16"), ("none", "float32")]


# -- the kernels: a row computed among M rows equals the row computed alone, bit for bit ------

ROWS = (5, 17, 37, 70)  # across every register-block and pass boundary the kernels have


def rows_alone(fn, x: torch.Tensor) -> torch.Tensor:
    return torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gguf_kernels_rows_independent(dtype):
    from test_kquant import random_blocks as kquant_blocks
    from test_quant_linear import random_blocks

    assert cpu_kernels.build()
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    N, K = 64, 512
    for kind in cpu_kernels.GGML_KINDS:
        blocks = torch.from_numpy(kquant_blocks(kind, N, K, rng)) if kind in cpu_kernels.K_KINDS else \
            random_blocks(kind, N, K, g)
        layouts = [(blocks, False), (cpu_kernels.repack_x8(blocks, kind, N), True)]
        for w, x8 in layouts:
            if w is None:  # no x8 layout for this kind here
                continue
            for M in ROWS + (130,):  # past the x8 kernel's 128-row block
                x = torch.randn(M, K, generator=g).to(dtype)
                fn = lambda r: cpu_kernels.quant_linear(r, w, kind, N, x8=x8)  # noqa: E731
                assert torch.equal(fn(x), rows_alone(fn, x)), (kind, x8, M)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dense_kernel_rows_independent(wdtype):
    assert cpu_kernels.build()
    g = torch.Generator().manual_seed(1)
    for N, K in ((66, 200), (64, 576)):  # N % 4 and K % 16 tails too
        w = (torch.randn(N, K, generator=g) * 0.05).to(wdtype)
        for xdtype in (torch.float32, torch.bfloat16):
            for M in ROWS + (130,):  # past a 64-row block
                x = torch.randn(M, K, generator=g).to(xdtype)
                fn = lambda r: cpu_kernels.small_m_linear(r, w, None)  # noqa: E731
                assert torch.equal(fn(x), rows_alone(fn, x)), (wdtype, xdtype, N, K, M)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_rows_attend_as_decode_rows(dtype):
    """A chunk at positions 20..59 of one request: each row equals that position's decode row."""
    assert cpu_kernels.build()
    g = torch.Generator().manual_seed(2)
    H, KVH, D, BS, done, n = 9, 3, 64, 16, 20, 40
    kc = torch.randn(8, KVH, BS, D, generator=g).to(dtype)
    vc = torch.randn(8, KVH, BS, D, generator=g).to(dtype)
    ids = torch.tensor([3, 1, 6, 4])
    q = torch.randn(n, H, D, generator=g).to(dtype)
    chunk = cpu_kernels.prefill_rows_attention(q, kc, vc, ids, done, 0.125)
    for i in range(n):
        row = cpu_kernels.decode_attention(q[i:i + 1], kc, vc, ids[None], torch.tensor([done + i + 1]), 0.125)
        assert torch.equal(chunk[i:i + 1], row), i


def tokens(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def make(gguf: str, quant: str, dtype: str, **kw) -> LLM:
    return LLM(gguf, dtype=dtype, quantization=quant, show_progress=False, **kw)


@pytest.fixture(scope="module", params=CONFIGS, ids=["-".join(c) for c in CONFIGS])
def reference(request, smollm_gguf):
    """Each prompt alone (no prefix caching, whole prefills), then all 16 together."""
    quant, dtype = request.param
    llm = make(smollm_gguf, quant, dtype, enable_prefix_caching=False, max_model_len=256,
               kv_cache_memory_bytes=64 << 20)
    alone = [tokens(llm.generate([p], SP, use_tqdm=False))[0] for p in PROMPTS]
    together = tokens(llm.generate(PROMPTS, SP, use_tqdm=False))
    llm.shutdown()
    return quant, dtype, alone, together


def test_together_equals_alone(reference):
    _, _, alone, together = reference
    assert together == alone


def test_chunked_prefill_and_prefix_hits(reference, smollm_gguf):
    """A 32-token step budget (every prompt is chunked, decodes mixed in), run twice: the
    second run's prompts hit the blocks the first left cached."""
    quant, dtype, alone, _ = reference
    llm = make(smollm_gguf, quant, dtype, max_num_batched_tokens=32, max_model_len=256,
               kv_cache_memory_bytes=64 << 20)
    assert min(len(llm.get_tokenizer().encode(p)) for p in PROMPTS) > 32
    chunked = tokens(llm.generate(PROMPTS, SP, use_tqdm=False))
    hits_before = llm.prefix_cache_stats.hits
    again = tokens(llm.generate(PROMPTS, SP, use_tqdm=False))
    hits = llm.prefix_cache_stats.hits - hits_before
    llm.shutdown()
    assert hits >= 16 * 32  # every prompt's first two blocks at least
    assert chunked == alone
    assert again == alone


def test_preemption_and_recompute(reference, smollm_gguf):
    """24 blocks of 16 tokens for 16 requests of 3-4 blocks each: the scheduler preempts and
    recomputes."""
    quant, dtype, alone, _ = reference
    layers, kv_heads, head_dim, block = 30, 3, 64, 16
    block_bytes = layers * 2 * kv_heads * block * head_dim * (2 if dtype == "bfloat16" else 4)
    llm = make(smollm_gguf, quant, dtype, max_model_len=128, kv_cache_memory_bytes=24 * block_bytes)
    out = tokens(llm.generate(PROMPTS, SP, use_tqdm=False))
    preempted = llm.engine.scheduler.num_preemptions
    llm.shutdown()
    assert preempted > 0
    assert out == alone


def test_same_command_twice_same_output(smollm_gguf):
    """Two processes, one command: identical text (no run-to-run variation from threads)."""
    cmd = [sys.executable, "-m", "lane.entrypoints.cli", "generate", PROMPTS[0], "--max-tokens", "24",
           "--model", smollm_gguf]
    env = {**os.environ, "LANE_LOGGING_LEVEL": "WARNING"}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]  # at once: their start-up overlaps
    runs = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    for out, err, rc in runs:
        assert rc == 0, err[-2000:]
    assert runs[0][0].strip() and runs[0][0] == runs[1][0]

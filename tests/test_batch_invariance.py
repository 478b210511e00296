"""Batch invariance, the default: a request's greedy tokens do not depend on the other
requests in its batch, on chunked prefill, on prefix-cache hits, on preemption and recompute,
or on the run, under --quantization auto and none, in bfloat16 and float32 (the embedded
SmolLM2). Exact token equality: a row of a prefill chunk is computed as the same row of a
decode step, bit for bit (cpu_kernels.BATCH_INVARIANT)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lane import LLM, SamplingParams

PREFIX = ("You are a careful assistant. Answer in one short paragraph, plainly, and do not repeat the "
          "question. Here is the question:")  # shared by all: later prompts hit its blocks
TOPICS = ["why the sky is blue", "how bees make honey", "what a compiler does", "why ice floats",
          "how a bicycle stays up", "what causes tides", "how vaccines work", "why cats purr",
          "what a black hole is", "how bread rises", "why leaves change colour", "how magnets work",
          "what rust is made of", "how a rainbow forms", "why we dream", "how a lock opens"]
PROMPTS = [f"{PREFIX} explain {t}." + " Please be brief." * (i % 4) for i, t in enumerate(TOPICS)]
SP = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
CONFIGS = [("auto", "bfloat16"), ("auto", "float32"), ("none", "bfloat16"), ("none", "float32")]


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

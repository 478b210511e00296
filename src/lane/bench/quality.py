"""Quality measures of an offline ``LLM`` on a fixed text: teacher-forced logits at every
position, fed a chunk of tokens a forward through the runner's own attention metadata, and
the perplexity they give (the quantized paths' check against the float32 path)."""
from __future__ import annotations

import math

import torch


def teacher_forced_logits(llm, ids: list[int], chunk: int = 16) -> torch.Tensor:
    """Logits [len(ids), vocab] (float32) of one request from position 0, ``chunk`` tokens a
    forward (chunk <= linear.quant_rows: the integer kernels' rows)."""
    from lane.attention.metadata import CommonAttentionMetadata, set_forward_context

    runner, model = llm.engine.worker.runner, llm.engine.worker.model
    table = tuple(list(range(1, 1 + -(-len(ids) // runner.block_size))) for _ in runner.kv_cache_config.groups)
    logits = []
    for s in range(0, len(ids), chunk):
        e = min(s + chunk, len(ids))
        md = runner._attn_metadata(CommonAttentionMetadata(0, [0], [e - s], [s], [s == 0]), [table])
        with torch.inference_mode(), set_forward_context(md):
            logits.append(model.compute_logits(model(torch.tensor(ids[s:e]), torch.arange(s, e))))
    return torch.cat(logits).float()


def perplexity(llm, ids: list[int], chunk: int = 16) -> float:
    nll = torch.nn.functional.cross_entropy(teacher_forced_logits(llm, ids, chunk)[:-1], torch.tensor(ids[1:]))
    return math.exp(float(nll))

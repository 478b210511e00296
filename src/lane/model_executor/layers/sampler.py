"""The sampler (seed step 34): penalties, min_tokens' stop-token mask, temperature,
top-k / top-p / min-p, per-request seeded generators, and logprobs with top-N alternatives.

Logprobs are those of the raw model distribution (vLLM's default
``raw_logprobs``), taken before penalties and temperature.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from lane.model_executor.layers import cpu_kernels

_EPS = 1e-5
_FORBIDDEN = 3e38  # finite: softmax gives it exactly 0, and -inf + it stays -inf


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [N]; 0 = greedy
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [N] int, 0 = off
    top_p: torch.Tensor | None = None  # [N], 1 = off
    min_p: torch.Tensor | None = None  # [N], 0 = off
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> seeded generator
    # penalties: None when no row uses them
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    repetition_penalty: torch.Tensor | None = None
    prompt_token_ids: list[list[int]] | None = None
    output_token_ids: list[list[int]] | None = None
    num_logprobs: list[int | None] = field(default_factory=list)  # per row; None = not asked
    # row -> token ids it must not sample: its stop tokens (EOS, stop_token_ids) while it has
    # fewer than min_tokens outputs
    masked_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # structured outputs: the constrained rows and their grammars' token bitmask [rows, ceil(V / 32)]
    bitmask_rows: list[int] = field(default_factory=list)
    bitmask: torch.Tensor | None = None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row: None, or (sampled logprob, sampled rank, [(token id, logprob)] top-N)
    logprobs: list[tuple | None]


def _counts(rows: list[list[int]], vocab: int) -> torch.Tensor:
    out = torch.zeros(len(rows), vocab)
    for i, ids in enumerate(rows):
        if ids:
            idx = torch.tensor(ids, dtype=torch.long)
            out[i].index_add_(0, idx, torch.ones(len(ids)))
    return out


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    V = logits.shape[-1]
    out_counts = _counts(md.output_token_ids, V)
    seen = out_counts > 0
    if md.repetition_penalty is not None:
        seen_any = seen | (_counts(md.prompt_token_ids, V) > 0)
        rp = md.repetition_penalty[:, None].expand_as(logits)
        penalised = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(seen_any, penalised, logits)
    if md.frequency_penalty is not None:
        logits = logits - md.frequency_penalty[:, None] * out_counts
    if md.presence_penalty is not None:
        logits = logits - md.presence_penalty[:, None] * seen.float()
    return logits


def apply_top_k_top_p_min_p(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    if md.top_k is not None:
        k = md.top_k.clamp(min=0)
        max_k = int(k.max())
        if max_k > 0:
            top = logits.topk(min(max_k, logits.shape[-1]), dim=-1).values
            kth = top.gather(1, (k.clamp(min=1, max=top.shape[1]) - 1)[:, None])
            kth = torch.where(k[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
            logits = logits.masked_fill(logits < kth, float("-inf"))
    if md.top_p is not None:
        sorted_logits, idx = logits.sort(dim=-1, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - md.top_p[:, None])
        drop[:, -1] = False  # always keep the most likely token
        logits = logits.scatter(1, idx, sorted_logits.masked_fill(drop, float("-inf")))
    if md.min_p is not None:
        probs = logits.softmax(dim=-1)
        floor = md.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Tokens a row's grammar forbids are pushed to a huge negative logit (in place), for the
    constrained rows only; bit j of word i allows token 32 i + j. Unpacked with numpy and
    added in one pass: a boolean masked_fill over [rows, V] costs 3-4x as much here."""
    V = logits.shape[-1]
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :V]
    penalty = torch.from_numpy((bits.astype(np.float32) - 1.0) * _FORBIDDEN)  # 0 where allowed
    logits.index_add_(0, torch.tensor(rows, dtype=torch.long), penalty)


def target_distribution(logits: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What each row samples from: (the greedy token after penalties and stop-token masks,
    the probabilities after temperature and top-k / top-p / min-p, or None when all rows are
    greedy). The rejection sampler verifies drafts against the same distribution."""
    penalized = md.repetition_penalty is not None or md.frequency_penalty is not None \
        or md.presence_penalty is not None
    if md.all_greedy and not penalized and md.bitmask is None and not md.masked_token_ids:
        # the logits as they came: the same argmax, without a float32 copy (1 ms at 64 bf16 rows)
        return cpu_kernels.argmax_rows(logits), None
    logits = logits.float()
    if penalized:
        logits = apply_penalties(logits, md)
    constrained = set(md.bitmask_rows) if md.bitmask is not None else set()
    if constrained:
        apply_token_bitmask(logits, md.bitmask_rows, md.bitmask)
    for row, ids in md.masked_token_ids.items():
        kept = logits[row, ids].clone() if row in constrained else None
        logits[row, ids] = float("-inf")
        if kept is not None and logits[row].max() < -_FORBIDDEN / 2:
            logits[row, ids] = kept  # its grammar allows only stopping: the grammar wins over min_tokens
    greedy = cpu_kernels.argmax_rows(logits)
    if md.all_greedy:
        return greedy, None
    temp = md.temperature.clamp(min=_EPS)[:, None]
    return greedy, apply_top_k_top_p_min_p(logits / temp, md).softmax(dim=-1)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [B, V] (rows need not be normalised) for uniforms u [B, 1]
    in (0, 1]: such a u never lands on a zero-probability token."""
    cdf = probs.cumsum(dim=-1)
    return torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def token_logprobs(raw_logprobs: torch.Tensor, tokens: list[int], num_logprobs: list[int | None]) -> list[tuple | None]:
    """Per row: None, or (the token's logprob, its rank, [(token id, logprob)] of the top N)."""
    out: list[tuple | None] = [None] * len(tokens)
    for row, n in enumerate(num_logprobs):
        if n is None:
            continue
        lp = raw_logprobs[row]
        tok_lp = lp[tokens[row]]
        rank = int((lp > tok_lp).sum()) + 1
        top = []
        if n > 0:
            vals, ids = lp.topk(n)
            top = list(zip(ids.tolist(), vals.tolist()))
        out[row] = (float(tok_lp), rank, top)
    return out


def sample(logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
    want_logprobs = any(n is not None for n in md.num_logprobs)
    raw_logprobs = logits.float().log_softmax(dim=-1) if want_logprobs else None
    greedy, probs = target_distribution(logits, md)
    if probs is None:
        tokens = greedy
    else:
        # inverse CDF: one uniform draw per row (torch's exponential_ over the whole
        # vocabulary, the race method, costs ~20 ns a token: 8 ms a step at batch 8).
        # u in (0, 1] never lands on a zero-probability token; a seeded request draws
        # from its own generator, whatever its batch
        u = 1.0 - torch.rand(len(probs), 1)
        for row, gen in md.generators.items():
            u[row] = 1.0 - torch.rand(1, generator=gen)
        tokens = torch.where(md.temperature < _EPS, greedy, inverse_cdf(probs, u))
    token_list = tokens.tolist()
    logprobs = (token_logprobs(raw_logprobs, token_list, md.num_logprobs) if raw_logprobs is not None
                else [None] * len(token_list))
    return SamplerOutput(token_list, logprobs)

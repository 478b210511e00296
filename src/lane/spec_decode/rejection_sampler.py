"""The rejection sampler (seed step 47), batched over requests.

Greedy: a draft is accepted while it equals the target's argmax at its position; the first
mismatch is replaced by the target's token; all accepted, the target's next token is a
bonus. Random: draft ``d`` at position i is accepted with probability min(1, p_i(d) / q_i(d))
(p the target's distribution, q the drafter's; one-hot for n-gram drafts); the first
rejected one is replaced by a sample from norm(max(p_i - q_i, 0)); all accepted, the bonus is
sampled from p_k. The output then follows p exactly, whatever q is (Leviathan et al. 2023).
Rows draw from their own generator when given one, so seeded requests are reproducible.
"""
from __future__ import annotations

import torch

from lane.model_executor.layers.sampler import inverse_cdf


def _uniform(counts: list[int], width: int, generators: list[torch.Generator | None] | None) -> torch.Tensor:
    """[B, width] uniforms, row b's first counts[b] drawn (from its generator if it has one), the
    rest 1: a row draws exactly as many numbers as it needs (none for a row without drafts)."""
    u = torch.ones(len(counts), width)
    gens = generators or [None] * len(counts)
    shared = [b for b, g in enumerate(gens) if g is None and counts[b]]
    if shared:
        draws = torch.rand(sum(counts[b] for b in shared)).split([counts[b] for b in shared])
        for b, x in zip(shared, draws):
            u[b, :counts[b]] = x
    for b, g in enumerate(gens):
        if g is not None and counts[b]:
            u[b, :counts[b]] = torch.rand(counts[b], generator=g)
    return u


def _sample(probs: torch.Tensor, generators: list[torch.Generator | None] | None) -> torch.Tensor:
    """One token per row of probs [B, V] (rows need not be normalised): the sampler's inverse
    CDF with its one draw u in (0, 1], so a seeded row without drafts samples exactly as it
    would with no speculation in the step."""
    return inverse_cdf(probs.float(), 1.0 - _uniform([1] * probs.shape[0], 1, generators))


def rejection_sample(draft_ids: torch.Tensor, target_probs: torch.Tensor, draft_probs: torch.Tensor | None = None,
                     num_drafts: list[int] | None = None, greedy: bool = False,
                     generators: list[torch.Generator | None] | None = None) -> list[list[int]]:
    """draft_ids [B, k]; target_probs [B, k + 1, V] (when greedy, the target's logits or its
    argmax ids [B, k + 1] suffice); draft_probs [B, k, V], or None for one-hot drafts (n-gram); num_drafts: each row's
    real drafts (<= k; the rest is padding). Returns each row's tokens: its accepted drafts,
    then one token from the target (1 .. k + 1 tokens)."""
    B, k = draft_ids.shape
    n = torch.tensor(num_drafts if num_drafts is not None else [k] * B)
    pos = torch.arange(k)[None, :]
    real = pos < n[:, None]
    d = draft_ids.clamp(min=0)
    if greedy:
        target = target_probs if target_probs.dim() == 2 else target_probs.argmax(-1)  # [B, k + 1]
        ok = (target[:, :k] == d) & real
    else:
        p = target_probs[:, :k].gather(2, d[..., None]).squeeze(-1)
        q = torch.ones_like(p) if draft_probs is None else draft_probs.gather(2, d[..., None]).squeeze(-1)
        u = _uniform(n.tolist(), k, generators)
        ok = (u * q < p) & real  # u < p / q without dividing by a zero q
    # accepted: the run of oks from the start
    accepted = torch.cumprod(ok.int(), dim=1).sum(1)  # [B]
    out = []
    rows = torch.arange(B)
    if greedy:
        final = target[rows, accepted]
    else:
        residual = target_probs[rows, accepted].clone()  # [B, V]: where the row's final token comes from
        rejected = accepted < n  # replaced, not a bonus: from norm(max(p - q, 0))
        if rejected.any():
            r = rows[rejected]
            a = accepted[rejected]
            if draft_probs is None:
                q_at = torch.zeros_like(residual[r]).scatter_(1, d[r, a][:, None], 1.0)
            else:
                q_at = draft_probs[r, a]
            left = (residual[r] - q_at).clamp_(min=0)
            empty = left.sum(-1, keepdim=True) <= 0  # p <= q everywhere: only if p == q (never rejected)
            residual[r] = torch.where(empty, residual[r], left)
        final = _sample(residual, generators)
    for b in range(B):
        a = int(accepted[b])
        out.append(draft_ids[b, :a].tolist() + [int(final[b])])
    return out

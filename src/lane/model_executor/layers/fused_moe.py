"""Mixture of experts: the router's expert choice (seed step 29) and the batched
expert FFN (step 30).

Experts are computed per expert, not per token: the (token, slot) pairs are sorted
by expert, so each active expert runs one gate/up and one down matmul over all of
its rows. Every layer counts the tokens each expert served (``expert_counts``):
the heat that expert load balancing reads.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from lane.model_executor.layers.activation import silu_and_mul
from lane.model_executor.layers import cpu_kernels
from lane.model_executor.layers.linear import int8_linear, linear


def grouped_topk(router_logits: torch.Tensor, top_k: int, *, scoring_func: str = "sigmoid",
                 correction_bias: torch.Tensor | None = None, num_expert_group: int | None = None,
                 topk_group: int | None = None, renormalize: bool = True,
                 routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's router: scores, group-limited top-k, weights. Returns
    (weights [T, k] float32, expert ids [T, k]).

    With ``correction_bias`` (``noaux_tc``) the bias steers only which experts are
    chosen; the weights are the unbiased scores. Groups are ranked by the sum of
    their two best (biased) scores, as the reference does, or by their best score
    without a bias."""
    logits = router_logits.float()
    if scoring_func == "sigmoid":
        scores = logits.sigmoid()
    elif scoring_func == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        raise ValueError(f"unsupported MoE scoring_func {scoring_func!r}")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    T, E = choice.shape
    if num_expert_group and num_expert_group > 1 and topk_group and topk_group < num_expert_group:
        grouped = choice.view(T, num_expert_group, E // num_expert_group)
        if correction_bias is None:
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // num_expert_group, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def fused_expert_name(name: str) -> str:
    """transformers' stacked expert tensors (``experts.gate_up_proj`` [E, 2I, H],
    ``experts.down_proj`` [E, H, I]) are FusedMoE's ``w13`` / ``w2`` as they are."""
    for hf, ours in ((".experts.gate_up_proj", ".experts.w13"), (".experts.down_proj", ".experts.w2")):
        if name.endswith(hf):
            return name[:-len(hf)] + ours
    return name


class FusedMoE(nn.Module):
    """Routed experts' weights as stacked tensors: ``w13`` [E, 2I, H] (gate | up),
    ``w2`` [E, H, I]; with --quantization int8 / w8a8, int8 per expert and output channel."""

    qkind: str | None = None  # "int8" / "w8a8" once quantize_int8 ran

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 swiglu_limit: float | None = None) -> None:
        super().__init__()
        self.swiglu_limit = swiglu_limit  # V4 clamps gate (above) and up (both sides)
        self.num_experts = num_experts
        self.top_k = top_k
        self.intermediate_size = intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # tokens routed to each expert since start-up (or the last reset)
        self.register_buffer("expert_counts", torch.zeros(num_experts, dtype=torch.long), persistent=False)

    def weight_shard(self, proj: str, expert: int) -> tuple[str, torch.Tensor]:
        """Where one expert's checkpoint matrix goes: ``proj`` is "gate", "up" or "down"
        -> (parameter name, the view to copy into)."""
        if proj == "down":
            return "w2", self.w2[expert]
        inter = self.intermediate_size
        return "w13", self.w13[expert].narrow(0, inter * (proj == "up"), inter)

    def quantize_int8(self, activations: bool) -> None:
        """The loaded experts to int8 per (expert, output channel): qw13 / qw2 int8 with fp32
        scales (and, for w8a8, int32 weight sums); the dense stacks go."""
        self.qkind = "w8a8" if activations else "int8"
        for name in ("w13", "w2"):
            w = getattr(self, name).detach()
            E, N, K = w.shape  # every (expert, output channel) is one row of the flattened stack
            q, scale = cpu_kernels.quantize_weight_int8(w.reshape(E * N, K))
            setattr(self, "q" + name, q.view(E, N, K))
            setattr(self, name + "_scale", scale.view(E, N))
            setattr(self, name + "_sums", cpu_kernels.int8_weight_sums(q).view(E, N) if activations else None)
            setattr(self, name, None)

    def quantized_tensors(self) -> list[torch.Tensor | None]:
        return [getattr(self, a, None) for a in ("qw13", "w13_scale", "w13_sums", "qw2", "w2_scale", "w2_sums")]

    def _expert(self, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.qkind is None:
            return linear(x, getattr(self, name)[e])
        sums = getattr(self, name + "_sums")
        return int8_linear(x, self.qkind, getattr(self, "q" + name)[e], getattr(self, name + "_scale")[e],
                           None if sums is None else sums[e])

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_weights, topk_ids [T, k] -> [T, H]"""
        k = topk_ids.shape[1]
        flat = topk_ids.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.expert_counts += counts
        token_of = order // k
        rows = x.index_select(0, token_of)
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                h = self._act(self._expert("w13", e, rows[start:start + n]))
                out[start:start + n] = self._expert("w2", e, h)
                start += n
        out *= topk_weights.reshape(-1)[order, None].to(out.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, out)

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.swiglu_limit is None:
            return silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        lim = self.swiglu_limit
        return F.silu(gate.clamp(max=lim)) * up.clamp(min=-lim, max=lim)

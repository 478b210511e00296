"""Mixture of experts: the router's expert choice (seed step 29) and the batched
expert FFN (step 30).

Experts are computed per expert, not per token: the (token, slot) pairs are sorted
by expert, so each active expert runs one gate/up and one down matmul over all of
its rows. Every layer counts the tokens each expert served (``expert_counts``):
the heat that expert load balancing reads.

Over several ranks (vLLM's layout): under tensor parallelism every rank holds a slice of
every expert's intermediate; with expert parallelism each holds ``num_experts / ep`` whole
experts and computes only the (token, slot) pairs routed to them. Either way a rank's output
is a partial sum that the caller all-reduces once, with the shared experts' (seed step 31).
Every rank of a replica holds every token, so dispatch needs no collective here; the combine
is that all-reduce (an all-gather + reduce-scatter would move the same bytes).

With data-parallel attention (``-dp N --enable-expert-parallel``) the experts spread over every
replica's ranks, whose tokens differ: each rank routes its share of its replica's rows, once,
and sends each (token, slot) pair's row to the rank holding the slot (an all-to-all, step 31);
the owners run their experts and send the outputs back (a second all-to-all), where they are
weighted and summed in the same order as on one rank (``forward_all_to_all``).

With EPLB (``eplb/``) a layer holds physical expert slots, E + R of them (R redundant), P / ep on
each rank; the router's logical choices go through the layer's ``ExpertMap`` to one replica each,
and each forward adds the tokens every slot served into the EPLB state's step buffer.
"""
from __future__ import annotations

import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from lane import tracing
from lane.distributed.parallel_state import (get_ep_group, get_expert_placement, get_tp_group, row_splits,
                                            sequence_parallel_enabled, sequence_parallel_splits)
from lane.eplb.placement import ExpertMap
from lane.model_executor.layers.activation import silu_and_mul
from lane.model_executor.layers import cpu_kernels
from lane.model_executor.layers.linear import ggml_linear, int8_linear, linear
from lane.tracing import Step


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


_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def load_expert_weight(model: nn.Module, name: str, tensor) -> str | None:
    """A routed expert's checkpoint tensor, one expert's (``mlp.experts.{e}.{gate,up,down}_proj``)
    or transformers' stacked ones, into its FusedMoE: the parameter's name; None where ``name``
    is no expert's."""
    if m := _EXPERT.match(name):
        return f"{m.group(1)}.{model.get_submodule(m.group(1)).load_expert(m.group(3), int(m.group(2)), tensor)}"
    name = fused_expert_name(name)
    if name.endswith((".experts.w13", ".experts.w2")):
        module, _, attr = name.rpartition(".")
        model.get_submodule(module).load_stacked(attr, tensor)  # lazy: its slices only
        return name
    return None


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
    # a GGUF's experts kept in their blocks (load_stack), by stack: "w13" / "w2" -> kind, with
    # qw13 uint8 [slots, 2I, row bytes] / qw2 [slots, H, row bytes] in place of the dense stack
    ggml_kinds: dict[str, str] = {}
    ggml_x8: frozenset[str] = frozenset()  # the stacks whose slots prepack_experts repacked (repack_x8)

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 swiglu_limit: float | None = None) -> None:
        super().__init__()
        self.swiglu_limit = swiglu_limit  # V4 clamps gate (above) and up (both sides)
        self.num_experts = num_experts
        self.top_k = top_k
        tp, ep = get_tp_group(), get_ep_group()
        placement = get_expert_placement()
        # physical slots: the logical experts, plus the redundant ones under EPLB
        self.num_physical = num_experts + (placement.num_redundant_experts if placement.eplb else 0)
        # expert parallel: whole experts in slots [expert_start, expert_start + local_experts); else a
        # 1/tp slice of every expert's intermediate
        self.ep_size, self.tp_size = ep.world_size, (1 if ep.world_size > 1 else tp.world_size)
        self._across_replicas = ep.world_size > tp.world_size
        self._split_rows = ep.world_size > 1 and sequence_parallel_enabled()
        self.ep = ep
        self.tp_rank = tp.rank_in_group if self.tp_size > 1 else 0
        self.local_experts = self.num_physical // self.ep_size
        self.expert_start = ep.rank_in_group * self.local_experts
        # EPLB: which logical expert each slot holds (None: slot i holds expert i, for good)
        self.expert_map = ExpertMap.initial(num_experts, self.num_physical) if placement.eplb else None
        self.eplb_load: torch.Tensor | None = None  # [P]: the EPLB state's step buffer row (layers it manages)
        self.full_intermediate_size = intermediate_size
        self.intermediate_size = inter = intermediate_size // self.tp_size
        self.w13 = nn.Parameter(torch.empty(self.local_experts, 2 * inter, hidden_size))
        self.w2 = nn.Parameter(torch.empty(self.local_experts, hidden_size, inter))
        # tokens routed to each logical expert (a rank counts its own slots) since start-up
        self.register_buffer("expert_counts", torch.zeros(num_experts, dtype=torch.long), persistent=False)

    @property
    def all_to_all(self) -> bool:
        """Whether this forward routes each token once, on its own rank, and dispatches it by
        all-to-all: where the experts span ranks that hold other tokens (data-parallel attention),
        and under sequence parallelism with whole experts per rank in a step whose rows are split.
        Otherwise every rank holds every row: each computes its experts' share, one all-reduce sums."""
        return self._across_replicas or (self._split_rows and sequence_parallel_splits() is not None)

    def local_logical(self) -> torch.Tensor:
        """The logical expert of each of this rank's slots [local_experts]."""
        lo, n = self.expert_start, self.local_experts
        return self.expert_map.phy2log[lo:lo + n] if self.expert_map is not None else torch.arange(lo, lo + n)

    def _slots_of(self, expert: int) -> list[int]:
        return [s for s, e in enumerate(self.local_logical().tolist()) if e == expert]

    def load_expert(self, proj: str, expert: int, tensor: torch.Tensor) -> str:
        """One expert's checkpoint matrix (``proj`` "gate", "up" or "down") into every slot of this
        rank that holds it (none: another rank's expert); returns the parameter's name."""
        inter = self.intermediate_size
        for e in self._slots_of(expert):
            if proj == "down":
                dst, src = self.w2[e], tensor.narrow(1, self.tp_rank * inter, inter)
            else:
                dst = self.w13[e].narrow(0, inter * (proj == "up"), inter)
                src = tensor.narrow(0, self.tp_rank * inter, inter)
            if dst.shape != src.shape:
                raise ValueError(f"expert {expert} {proj}: checkpoint shape {tuple(tensor.shape)} does not fit "
                                 f"{tuple(dst.shape)} on this rank")
            with torch.no_grad():
                dst.copy_(src)
        return "w2" if proj == "down" else "w13"

    def load_stacked(self, attr: str, tensor: torch.Tensor) -> None:
        """transformers' stacked tensors (``w13`` [E, 2I, H] gate | up, ``w2`` [E, H, I]), lazy or
        not: only this rank's experts, and of each its slice of the intermediate, are read."""
        want = (self.num_experts, 2 * self.full_intermediate_size, self.w13.shape[2]) if attr == "w13" else \
            (self.num_experts, self.w2.shape[1], self.full_intermediate_size)
        if tuple(tensor.shape) != want:
            raise ValueError(f"stacked experts {attr}: checkpoint shape {tuple(tensor.shape)} != {want}")
        all_ = slice(None)
        inter, lo = self.intermediate_size, self.tp_rank * self.intermediate_size
        full = self.full_intermediate_size
        parts = []
        for mine in _runs(self.local_logical().tolist()):  # the slots' experts, a slice per consecutive run
            if attr == "w2":
                parts.append(tensor[mine, all_, lo:lo + inter])
            else:
                parts.append(torch.cat((tensor[mine, lo:lo + inter], tensor[mine, full + lo:full + lo + inter]), dim=1))
        with torch.no_grad():
            getattr(self, attr).copy_(torch.cat(parts) if len(parts) > 1 else parts[0])

    def load_stack(self, proj: str, tensor) -> str:
        """Every expert's ``proj`` ("gate", "up", "down") stacked, as a GGUF holds them
        (``ffn_{gate,up,down}_exps``): dense [E, rows, cols], or GGUF blocks of [E * rows, cols],
        kept as they are where this rank holds whole experts and gate and up share a kind."""
        from lane.model_executor.loader.gguf_loader import GGMLBlocks

        name = "w2" if proj == "down" else "w13"
        if isinstance(tensor, GGMLBlocks):
            keep = self.tp_size == 1 and cpu_kernels.build() and self.ggml_kinds.get(name, tensor.kind) == tensor.kind
            if keep:
                self._load_blocks(name, proj, tensor)
                return name
            if name in self.ggml_kinds:  # gate and up of different kinds: the stack runs dense
                self._densify(name)
            tensor = tensor.dequantize().view(self.num_experts, -1, tensor.shape[1])
        for e in range(self.num_experts):  # load_expert skips the experts this rank does not hold
            self.load_expert(proj, e, tensor[e])
        return name

    def _load_blocks(self, name: str, proj: str, tensor) -> None:
        rows = tensor.shape[0] // self.num_experts
        blocks = tensor.blocks.view(self.num_experts, rows, -1)
        if name not in self.ggml_kinds:
            self.ggml_kinds = {**self.ggml_kinds, name: tensor.kind}
            n = 2 * self.intermediate_size if name == "w13" else rows
            setattr(self, "q" + name, torch.empty(self.local_experts, n, blocks.shape[2], dtype=torch.uint8))
            self.dense_dtype = getattr(self, name).dtype
            setattr(self, name, None)  # its memory goes; the experts run from the blocks
        q = getattr(self, "q" + name)
        at = rows if proj == "up" else 0
        for slot, e in enumerate(self.local_logical().tolist()):
            q[slot, at:at + rows] = blocks[e]

    def _densify(self, name: str) -> None:
        """A stack whose parts came in different kinds: its blocks dequantized, run dense."""
        q, kind = getattr(self, "q" + name), self.ggml_kinds[name]
        dense = cpu_kernels.dequant_ggml(q.reshape(-1, q.shape[2]).numpy(), kind, self.dense_dtype)
        setattr(self, name, nn.Parameter(dense.view(q.shape[0], q.shape[1], -1), requires_grad=False))
        setattr(self, "q" + name, None)
        self.ggml_kinds = {k: v for k, v in self.ggml_kinds.items() if k != name}

    def prepack_experts(self) -> bool:
        """Each slot's GGUF blocks repacked 8 rows interleaved, in place, where the kind allows (as
        Linear.prepack does): an expert's rows then run the 8-row kernel. EPLB moves slots as they
        are, so the layout moves with them."""
        for name, kind in self.ggml_kinds.items():
            q = getattr(self, "q" + name)
            if name in self.ggml_x8 or not cpu_kernels.x8_fits(kind, q.shape[1]):
                continue
            for slot in range(q.shape[0]):
                q[slot] = cpu_kernels.repack_x8(q[slot], kind, q.shape[1])
            self.ggml_x8 = self.ggml_x8 | {name}
        return bool(self.ggml_x8)

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

    def slot_tensors(self) -> list[torch.Tensor]:
        """Every tensor that holds a slot's weights (first dimension: this rank's slots), with the
        scales and sums of quantized experts: what EPLB moves."""
        dense = [w.data for w in (self.w13, self.w2) if w is not None]
        return dense + [t for t in self.quantized_tensors() if t is not None]

    def _expert(self, name: str, e: int, x: torch.Tensor) -> torch.Tensor:
        if name in self.ggml_kinds:
            blocks = getattr(self, "q" + name)[e]
            # (an expert mostly sees a row or two a step, where the int8 kernels beat the bf16
            # tiles 4x: they keep every expert's rows, whatever their count)
            return ggml_linear(x, blocks, self.ggml_kinds[name], (blocks.shape[0], x.shape[1]),
                               x8=name in self.ggml_x8, int8=True)
        if self.qkind is None:
            return linear(x, getattr(self, name)[e])
        sums = getattr(self, name + "_sums")
        return int8_linear(x, self.qkind, getattr(self, "q" + name)[e], getattr(self, name + "_scale")[e],
                           None if sums is None else sums[e])

    def _count(self, counts: torch.Tensor) -> None:
        self.expert_counts.index_add_(0, self.local_logical(), counts)
        if self.eplb_load is not None:  # heat, per physical slot (EPLB's window reads it)
            self.eplb_load[self.expert_start:self.expert_start + self.local_experts] += counts

    def _run_sorted(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows grouped by local slot (``counts[e]`` rows for slot e, in slot order) -> each row's
        output of its slot's expert, unweighted."""
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                h = self._act(self._expert("w13", e, rows[start:start + n]))
                out[start:start + n] = self._expert("w2", e, h)
                start += n
        return out

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]; topk_weights, topk_ids [T, k] -> [T, H] (this rank's part of the sum)"""
        k = topk_ids.shape[1]
        if self.expert_map is not None:  # logical -> one physical replica each
            topk_ids = self.expert_map.to_physical(topk_ids)
        flat, weights = topk_ids.reshape(-1), topk_weights.reshape(-1)
        token = None  # pair i's token is i // k, unless pairs were dropped
        if self.ep_size > 1:  # the pairs routed to this rank's slots
            mine = (flat >= self.expert_start) & (flat < self.expert_start + self.local_experts)
            token = (torch.arange(flat.numel()) // k)[mine]
            flat, weights = flat[mine] - self.expert_start, weights[mine]
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.local_experts)
        self._count(counts)
        token_of = order // k if token is None else token[order]
        out = self._run_sorted(x.index_select(0, token_of), counts)
        out *= weights[order, None].to(out.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, out)

    def forward_all_to_all(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H]: this rank's rows, routed here alone -> [T, H], the routed experts' whole sum
        for them. Each pair's row goes to its slot's rank and its output comes back (step 31);
        the owners compute (step 30)."""
        mark = tracing.forward_mark()
        k = topk_ids.shape[1]
        if self.expert_map is not None:
            topk_ids = self.expert_map.to_physical(topk_ids)
        flat, weights = topk_ids.reshape(-1), topk_weights.reshape(-1)
        owner = flat // self.local_experts
        by_owner = owner.argsort(stable=True)
        send = torch.bincount(owner, minlength=self.ep_size).tolist()
        mark(Step.OPS_FFN)
        rows, recv = self.ep.all_to_all(x.index_select(0, by_owner // k), send, Step.COMM_FFN_REDUCE)
        slots, _ = self.ep.all_to_all(flat[by_owner], send, Step.COMM_FFN_REDUCE)
        mark(Step.COMM_FFN_REDUCE)
        local = slots - self.expert_start
        order = local.argsort(stable=True)
        counts = torch.bincount(local, minlength=self.local_experts)
        self._count(counts)
        done = torch.empty_like(rows)
        done[order] = self._run_sorted(rows[order], counts)
        mark(Step.OPS_FFN)
        back, _ = self.ep.all_to_all(done, recv, Step.COMM_FFN_REDUCE)
        mark(Step.COMM_FFN_REDUCE)
        pair_out = torch.empty_like(back)
        pair_out[by_owner] = back
        order = flat.argsort(stable=True)  # summed in one rank's order: by slot, then pair
        out = pair_out[order] * weights[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, order // k, out)

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.swiglu_limit is None:
            return silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        lim = self.swiglu_limit
        return F.silu(gate.clamp(max=lim)) * up.clamp(min=-lim, max=lim)


def _runs(ids: list[int]) -> list[slice]:
    """Consecutive ascending runs of expert ids as slices: [3, 4, 5, 0, 1] -> [3:6, 0:2]."""
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[i - 1] + 1:
            out.append(slice(ids[start], ids[i - 1] + 1))
            start = i
    return out


def share_rows(tp, x: torch.Tensor) -> torch.Tensor:
    """This rank's share of rows every rank of its replica holds (dim 0 split as
    ``row_splits``): under data-parallel attention each token is routed once, by one rank."""
    if tp.world_size == 1:
        return x
    splits = row_splits(x.shape[0], tp.world_size)
    r = tp.rank_in_group
    return x.narrow(0, sum(splits[:r]), splits[r])


def combine_routed(tp, routed: torch.Tensor, shared: torch.Tensor | None, num_rows: int) -> torch.Tensor:
    """The FFN's output rows this rank hands on: its share's routed sums (``routed``) gathered
    over the replica's ranks (under sequence parallelism it keeps its own rows), plus the shared
    experts' partial sums reduced over them (step 31)."""
    if tp.world_size == 1:
        return routed if shared is None else routed + shared
    splits = row_splits(num_rows, tp.world_size)
    if sequence_parallel_splits() is not None:
        return routed if shared is None else routed + tp.reduce_scatter(shared, splits, Step.COMM_FFN_REDUCE)
    out = tp.all_gather_rows(routed, splits, Step.COMM_FFN_REDUCE)
    return out if shared is None else out + tp.all_reduce(shared, Step.COMM_FFN_REDUCE)

"""Moving expert weights between ranks for a new placement (seed step 54), one MoE layer at a
time: vLLM's ``rebalance_execute`` shape, ours.

Every rank computes the same plan from the old and new maps, so no one negotiates:

- a slot whose expert does not change is left alone;
- a slot whose new expert this rank already held (in any old slot) is a local copy;
- otherwise the expert comes from a rank that held it: the receivers of expert e (in rank
  order) take turns over its holders (in rank order), each receiver once per expert, however
  many of its slots need it.

The sends and receives of a layer go out together (``batch_isend_irecv`` over the EP group:
gloo point-to-point on a CPU) into buffers; only when all have arrived are the slots
overwritten, so a send always reads the old weights. Quantized experts move with their
scales and sums: every tensor ``FusedMoE.slot_tensors()`` names.
"""
from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

import torch


@dataclass
class LayerPlan:
    """What one layer's move does on every rank."""
    # (rank, new slot, old slot on that rank to copy from)
    local_copies: list[tuple[int, int, int]] = field(default_factory=list)
    # (expert, sender rank, sender's old slot, receiver rank)
    transfers: list[tuple[int, int, int, int]] = field(default_factory=list)
    # (rank, new slot, expert): slots filled from a received expert
    received: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def experts_moved(self) -> int:
        return len(self.transfers)

    @property
    def changed(self) -> bool:
        return bool(self.local_copies or self.received)


def plan_layer(old: list[int], new: list[int], ep_size: int) -> LayerPlan:
    """old / new: the layer's phy2log before and after (every rank's slots)."""
    local = len(old) // ep_size
    plan = LayerPlan()
    held = [old[r * local:(r + 1) * local] for r in range(ep_size)]
    need: dict[int, list[int]] = {}  # expert -> receiver ranks
    for r in range(ep_size):
        for s in range(local):
            e = new[r * local + s]
            if e == held[r][s]:
                continue
            if e in held[r]:
                plan.local_copies.append((r, s, held[r].index(e)))
            else:
                plan.received.append((r, s, e))
                if r not in need.setdefault(e, []):
                    need[e].append(r)
    for e in sorted(need):
        holders = [r for r in range(ep_size) if e in held[r]]
        for i, r in enumerate(need[e]):
            src = holders[i % len(holders)]
            plan.transfers.append((e, src, held[src].index(e), r))
    return plan


def slot_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes one slot's weights take (with scales and sums)."""
    return sum(t[0].numel() * t.element_size() for t in tensors)


def move_layer(plan: LayerPlan, tensors: list[torch.Tensor], rank: int, ep_ranks: list[int], group,
               fault_hook=None) -> None:
    """Carry out ``plan`` for this rank (``rank``: its index in the EP group, whose global ranks
    are ``ep_ranks``). ``fault_hook`` runs after the receives, before any slot is overwritten."""
    import torch.distributed as dist

    ops, inbox = [], {}
    for e, src, src_slot, dst in plan.transfers:
        for i, t in enumerate(tensors):
            tag = e * len(tensors) + i
            if src == rank:
                ops.append(dist.P2POp(dist.isend, t[src_slot].contiguous(), ep_ranks[dst], group, tag))
            if dst == rank:
                buf = inbox.setdefault(e, [torch.empty_like(x[0]) for x in tensors])[i]
                ops.append(dist.P2POp(dist.irecv, buf, ep_ranks[src], group, tag))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    if fault_hook is not None:
        fault_hook()
    # local copies read old slots: take them before anything is overwritten
    staged = {s: [t[src].clone() for t in tensors] for r, s, src in plan.local_copies if r == rank}
    staged.update({s: inbox[e] for r, s, e in plan.received if r == rank})
    with torch.no_grad():
        for s, parts in staged.items():
            for t, part in zip(tensors, parts):
                t[s].copy_(part)


def fault_hook_for(rank: int):
    """Tests only: LANE_FAULT_INJECT=eplb_move:R makes EP rank R SIGKILL itself after receiving
    its first moved layer's weights, before copying them into place (a rank lost mid-move)."""
    fault = os.environ.get("LANE_FAULT_INJECT", "")
    if fault.startswith("eplb_move:") and int(fault.split(":")[1]) == rank:
        return lambda: os.kill(os.getpid(), signal.SIGKILL)
    return None

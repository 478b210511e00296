"""Physical expert slots and the maps between them and logical experts.

A MoE layer of E logical experts holds P = E + R physical slots (R redundant), P / ep on each
expert-parallel rank, rank r owning slots [r * P/ep, (r + 1) * P/ep). Per layer:

- ``phy2log`` [P]: the logical expert each slot holds;
- ``log2phy`` [E, R + 1]: each logical expert's slots in increasing order, -1 padded;
- ``replica_count`` [E]: how many slots hold it.

Every rank keeps identical maps. The initial map puts expert ``i % E`` in slot i, so the
redundant slots hold experts 0, 1, ... (vLLM's initial placement).

Replica choice: the (token t, top-k slot j) pair of logical expert e goes to replica
``(t + j) % replica_count[e]``, t the token's row in the forward's batch. A pure function of
data every rank has, so every rank routes a token identically (without an all-to-all each
rank sees every token: ranks that chose differently would compute a pair twice or never).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def initial_phy2log(num_layers: int, num_logical: int, num_physical: int) -> torch.Tensor:
    return (torch.arange(num_physical) % num_logical).repeat(num_layers, 1)


def logical_maps(phy2log: torch.Tensor, num_logical: int) -> tuple[torch.Tensor, torch.Tensor]:
    """phy2log [L, P] -> (log2phy [L, E, P - E + 1] (-1 padded, slots in increasing order),
    replica_count [L, E])."""
    L, P = phy2log.shape
    count = torch.zeros(L, num_logical, dtype=torch.long).scatter_add_(1, phy2log, torch.ones_like(phy2log))
    log2phy = torch.full((L, num_logical, P - num_logical + 1), -1, dtype=torch.long)
    # each slot's replica index: how many earlier slots of the layer hold the same expert
    same = phy2log.unsqueeze(2) == phy2log.unsqueeze(1)  # [L, P, P]
    replica = torch.tril(same, diagonal=-1).sum(-1)
    log2phy.view(L, -1).scatter_(1, phy2log * log2phy.shape[2] + replica, torch.arange(P).expand(L, P).contiguous())
    return log2phy, count


def keep_in_place(old: torch.Tensor, new: torch.Tensor, ep_size: int) -> torch.Tensor:
    """``new`` [L, P] reordered inside each rank so that a slot whose old expert the rank still
    holds keeps it (no copy for it); the rank's other new experts fill its other slots in order."""
    L, P = new.shape
    local = P // ep_size
    out = new.clone()
    for layer in range(L):
        for r in range(ep_size):
            lo = r * local
            before, wanted = old[layer, lo:lo + local].tolist(), new[layer, lo:lo + local].tolist()
            placed: list[int | None] = [None] * local
            left = list(wanted)
            for s, e in enumerate(before):
                if e in left:
                    placed[s] = e
                    left.remove(e)
            it = iter(left)
            out[layer, lo:lo + local] = torch.tensor([e if e is not None else next(it) for e in placed])
    return out


def rank_loads(physical_load: torch.Tensor, ep_size: int) -> torch.Tensor:
    """[L, P] tokens per slot -> [L, ep] tokens per rank."""
    L, P = physical_load.shape
    return physical_load.view(L, ep_size, P // ep_size).sum(-1)


def balancedness(rank_load: torch.Tensor) -> torch.Tensor:
    """[L, ep] -> [L]: mean over max rank load (1.0: perfectly even; an idle layer counts 1.0)."""
    load = rank_load.double()
    peak = load.max(dim=-1).values
    return torch.where(peak > 0, load.mean(dim=-1) / peak.clamp(min=1e-12), torch.ones_like(peak))


def expected_physical_load(logical_load: torch.Tensor, phy2log: torch.Tensor, replica_count: torch.Tensor
                           ) -> torch.Tensor:
    """Each logical expert's load spread evenly over its replicas, per slot [L, P]: what the
    replica choice gives for the same traffic (how a new placement is judged before it serves)."""
    per_replica = logical_load.double() / replica_count.double()
    return per_replica.gather(1, phy2log)


@dataclass
class ExpertMap:
    """One layer's maps (views of the EPLB state's stacked maps, so a rearrangement that copies
    into those is seen here)."""
    phy2log: torch.Tensor  # [P]
    log2phy: torch.Tensor  # [E, R + 1]
    replica_count: torch.Tensor  # [E]

    @classmethod
    def initial(cls, num_logical: int, num_physical: int) -> "ExpertMap":
        phy2log = initial_phy2log(1, num_logical, num_physical)
        log2phy, count = logical_maps(phy2log, num_logical)
        return cls(phy2log[0], log2phy[0], count[0])

    def to_physical(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Logical ids [T, k] -> physical slots [T, k]: replica (t + j) % replica_count."""
        T, k = topk_ids.shape
        choice = (torch.arange(T).unsqueeze(1) + torch.arange(k)) % self.replica_count[topk_ids]
        return self.log2phy[topk_ids, choice]

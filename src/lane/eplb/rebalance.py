"""DeepSeek's expert rebalancing (deepseek-ai/EPLB ``rebalance_experts``), in torch, ours.

Given each layer's load per logical expert, choose which logical expert each physical slot
holds so that the busiest rank's load is as small as the packing allows:

1. pack the routing groups onto nodes, equal numbers of groups per node, balancing load
   (hierarchical only: the groups divide over the nodes, so a token's group-limited experts
   stay on few nodes);
2. inside each node, give the redundant slots to the experts with the highest load per
   replica, one at a time;
3. pack each node's physical experts onto its ranks, equal numbers per rank, balancing the
   load per replica.

With one group and one node, steps 1 and 3 are the plain global version. Everything here is
integer bookkeeping plus float loads, deterministic for a given input.
"""
from __future__ import annotations

import torch


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [L, N] -> (pack [L, N], slot_in_pack [L, N]): N items into ``num_packs`` packs of
    N / num_packs items each, heaviest item first into the lightest pack that has room."""
    L, N = weight.shape
    per_pack = N // num_packs
    if per_pack == 1:  # one item a pack: nothing to choose
        return torch.arange(N).expand(L, N).clone(), torch.zeros(L, N, dtype=torch.long)
    pack = torch.empty(L, N, dtype=torch.long)
    slot = torch.empty(L, N, dtype=torch.long)
    order = weight.float().argsort(dim=-1, descending=True, stable=True)
    for layer in range(L):
        loads = [0.0] * num_packs
        counts = [0] * num_packs
        w = weight[layer].tolist()
        for item in order[layer].tolist():
            p = min((q for q in range(num_packs) if counts[q] < per_pack), key=lambda q: (loads[q], q))
            pack[layer, item], slot[layer, item] = p, counts[p]
            loads[p] += w[item]
            counts[p] += 1
    return pack, slot


def replicate_experts(weight: torch.Tensor, num_physical: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [L, E] -> (phy2log [L, P], replica_index [L, P], replica_count [L, E]): slot i < E
    holds expert i; each further slot goes to the expert whose load per replica is highest."""
    L, E = weight.shape
    phy2log = torch.arange(num_physical).repeat(L, 1)
    replica = torch.zeros(L, num_physical, dtype=torch.long)
    count = torch.ones(L, E, dtype=torch.long)
    rows = torch.arange(L)
    for i in range(E, num_physical):
        hottest = (weight / count).argmax(dim=-1)  # the first of equals: deterministic
        phy2log[:, i] = hottest
        replica[:, i] = count[rows, hottest]
        count[rows, hottest] += 1
    return phy2log, replica, count


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """Row-wise inverse of a permutation [L, N]."""
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.shape[1]).expand_as(perm).contiguous())
    return inv


def rebalance_hierarchical(weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int,
                           num_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(phy2log [L, P], replica_count [L, E]) for ``weight`` [L, E] (float loads)."""
    L, E = weight.shape
    group_size = E // num_groups
    groups_per_node = num_groups // num_nodes
    experts_per_node = E // num_nodes
    physical_per_node = num_physical // num_nodes
    # 1. groups onto nodes; "m-logical" numbers the experts node by node
    group_load = weight.view(L, num_groups, group_size).sum(-1)
    node, slot = balanced_packing(group_load, num_nodes)
    first = (node * groups_per_node + slot) * group_size  # [L, groups]: the group's first m-logical id
    log2m = (first.unsqueeze(-1) + torch.arange(group_size)).flatten(1)  # [L, E]
    m2log = _inverse(log2m)
    # 2. replicas inside each node
    m_load = weight.gather(1, m2log).view(L * num_nodes, experts_per_node)
    phy2m, _, m_count = replicate_experts(m_load, physical_per_node)
    # 3. each node's physical experts onto its ranks, by load per replica
    per_replica = (m_load / m_count).gather(1, phy2m)
    rank, slot = balanced_packing(per_replica, num_ranks // num_nodes)
    placed = _inverse(rank * (num_physical // num_ranks) + slot)  # slot on the node -> physical expert
    slot2m = phy2m.gather(1, placed).view(L, num_nodes, physical_per_node)
    slot2m = (slot2m + torch.arange(num_nodes).view(1, -1, 1) * experts_per_node).flatten(1)
    phy2log = m2log.gather(1, slot2m)
    count = m_count.view(L, E).gather(1, log2m)
    return phy2log, count


def rebalance_experts(weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int,
                      num_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's policy: hierarchical when the routing groups divide over the nodes (and the
    experts over the groups), else global. Returns (phy2log [L, P], replica_count [L, E])."""
    weight = weight.float().cpu()
    E = weight.shape[1]
    if not (num_groups >= 1 and E % num_groups == 0 and num_groups % num_nodes == 0):
        num_groups, num_nodes = 1, 1
    return rebalance_hierarchical(weight, num_physical, num_groups, num_nodes, num_ranks)

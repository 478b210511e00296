"""Which blocks of a request move, and moving their contents in and out of the cache tensors
(shared by the connectors).

A request's first ``end`` tokens (a whole number of blocks) move as the blocks that hold them,
per KV cache group:
- full groups (K/V, MLA latents, indexer keys, V4's compressed entries and their block-edge
  snapshots): every block from ``start`` to ``end``;
- sliding-window groups: only the blocks the next query's window sees (the others are the null
  block on both sides);
- running-state groups: nothing; a request resumed at a block edge rebuilds its state from the
  block-edge snapshots in the full group, as on a prefix-cache hit.
"""
from __future__ import annotations

import torch

from lane.kv_cache_interface import FULL, SLIDING_WINDOW, KVCacheConfig

NULL_BLOCK = 0


def first_window_block(num_tokens: int, window: int, block_size: int) -> int:
    """The first block the query at position ``num_tokens`` sees through a window."""
    return max(0, num_tokens - window + 1) // block_size


def block_plan(config: KVCacheConfig, block_ids: tuple[list[int], ...], start: int, end: int,
               with_state: bool = False) -> list[list[tuple[int, int]]]:
    """Per group: (block position in the request's table, block id) of the blocks that hold
    tokens [start, end) and are needed to go on from ``end`` (``start`` is a block edge; a
    partial last block moves whole: the slots past ``end`` are overwritten when computed).
    ``with_state``: running-state groups move their slot too (a transfer that resumes mid-block)."""
    out: list[list[tuple[int, int]]] = []
    for group, ids in zip(config.groups, block_ids):
        bs = group.block_size
        if group.kind == FULL:
            first = start // bs
        elif group.kind == SLIDING_WINDOW:
            first = max(start // bs, first_window_block(end, group.sliding_window, bs))
        else:
            out.append([(0, ids[0])] if with_state and ids else [])
            continue
        out.append([(p, ids[p]) for p in range(first, -(-end // bs)) if p < len(ids) and ids[p] != NULL_BLOCK])
    return out


def gather(kv_caches: dict[str, torch.Tensor], group_of: dict[str, int], plan: list[list[tuple[int, int]]]
           ) -> dict[str, torch.Tensor]:
    """Every cache tensor's planned blocks, [n, *block shape] each (copies)."""
    out = {}
    for name, t in kv_caches.items():
        ids = [b for _, b in plan[group_of[name]]]
        if ids:
            out[name] = t[torch.tensor(ids)].contiguous()
    return out


def scatter(kv_caches: dict[str, torch.Tensor], group_of: dict[str, int], plan: list[list[tuple[int, int]]],
            data: dict[str, torch.Tensor], positions: list[list[int]]) -> int:
    """Write ``data`` (blocks at ``positions`` of the sender's table, per group) into the planned
    blocks (positions in this table). Returns the bytes written. Raises if a planned position
    was not sent."""
    nbytes = 0
    for name, t in kv_caches.items():
        g = group_of[name]
        want = plan[g]
        if not want:
            continue
        index = {p: i for i, p in enumerate(positions[g])}
        missing = [p for p, _ in want if p not in index]
        if missing:
            raise ValueError(f"KV transfer: block positions {missing} of {name} were not sent")
        src = data[name][torch.tensor([index[p] for p, _ in want])]
        t[torch.tensor([b for _, b in want])] = src.to(t.dtype)
        nbytes += src.numel() * src.element_size()
    return nbytes

"""Attention metadata: what one step's flattened batch looks like to the cache layers,
one object per KV cache group, and the forward context that carries them.

The runner describes the batch once (``CommonAttentionMetadata``: decodes first, then
prefill chunks); the layers' backend builds each group's metadata from it and the
group's block tables: ``PagedAttentionMetadata`` for a block group (slots, tables),
``RunningStateMetadata`` for a running-state group (each request's slot). A layer finds
its group's metadata through the group index it was bound to with its cache tensor.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class CommonAttentionMetadata:
    """The batch, request by request in row order (decodes, then prefill chunks)."""
    num_decodes: int
    query_start: list[int]  # rows [query_start[i], query_end[i]) of the flattened batch
    query_end: list[int]
    num_computed: list[int]  # tokens of the request already cached before this step
    fresh: list[bool]  # the request's first chunk since (re)admission
    # drafts among each request's rows (speculative decoding), empty when none: such rows
    # may be rejected after the step, and running state must be able to fall back
    num_drafts: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.query_start)


class BatchLayout:
    """Builds a step's ``CommonAttentionMetadata`` request by request (decodes first): a
    request is one entry, or with ``decode_rows`` one query-length-1 entry per row, each
    seeing the cache up to itself (for layers whose decode rows are independent)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.num_computed: list[int] = []
        self.fresh: list[bool] = []
        self.num_drafts: list[int] = []
        self.block_ids: list = []  # per entry: the request's tables
        self.num_decodes = 0
        self.num_rows = 0

    def add(self, block_ids, num_computed: int, num_rows: int, decode_rows: bool, fresh: bool = False,
            num_drafts: int = 0) -> None:
        if decode_rows:
            for j in range(num_rows):
                self.starts.append(self.num_rows + j)
                self.num_computed.append(num_computed + j)
                self.fresh.append(False)
                self.num_drafts.append(0)
                self.block_ids.append(block_ids)
            self.num_decodes += num_rows
        else:
            self.starts.append(self.num_rows)
            self.num_computed.append(num_computed)
            self.fresh.append(fresh)
            self.num_drafts.append(num_drafts)
            self.block_ids.append(block_ids)
        self.num_rows += num_rows

    def common(self, with_drafts: bool = False) -> CommonAttentionMetadata:
        return CommonAttentionMetadata(self.num_decodes, self.starts, self.starts[1:] + [self.num_rows],
                                       self.num_computed, self.fresh, self.num_drafts if with_drafts else [])


@dataclass
class PrefillSpan:
    query_start: int  # rows [query_start, query_end) of the flattened batch
    query_end: int
    num_computed: int  # tokens of this request already in the cache before the chunk
    block_ids: torch.Tensor  # the request's blocks covering num_computed + chunk


@dataclass
class PagedAttentionMetadata:
    """One block group's view of the step."""
    slot_mapping: torch.Tensor  # [T] flat cache slot of each token (block * block_size + offset)
    num_decodes: int = 0  # leading rows that are query-length-1 requests
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks], null-padded
    decode_context_lens: torch.Tensor | None = None  # [B] int32
    prefills: list[PrefillSpan] = field(default_factory=list)


@dataclass
class RunningStateMetadata:
    """A running-state group's view: each request's slot, and whether its state starts anew."""
    decode_slots: torch.Tensor  # [B] long
    prefill_slots: list[int]
    prefill_fresh: list[bool]
    prefill_verify: list[bool] = field(default_factory=list)  # the chunk ends in drafts
    num_decodes: int = 0  # leading rows, one per decode
    prefill_rows: list[tuple[int, int]] = field(default_factory=list)  # each chunk's rows [start, end)


def build_paged_metadata(common: CommonAttentionMetadata, block_ids: list[list[int]],
                         block_size: int) -> PagedAttentionMetadata:
    """Slots and block tables of one block group, from each request's block ids."""
    bs, nd = block_size, common.num_decodes
    slots: list[int] = []
    for ids, s, e, nc in zip(block_ids, common.query_start, common.query_end, common.num_computed):
        slots.extend(ids[p // bs] * bs + p % bs for p in range(nc, nc + e - s))
    md = PagedAttentionMetadata(torch.tensor(slots, dtype=torch.long), nd)
    if nd:
        lens = [nc + 1 for nc in common.num_computed[:nd]]
        max_blocks = -(-max(lens) // bs)
        md.decode_block_tables = torch.tensor(
            [ids[:max_blocks] + [0] * (max_blocks - min(len(ids), max_blocks)) for ids in block_ids[:nd]],
            dtype=torch.long)
        md.decode_context_lens = torch.tensor(lens, dtype=torch.int32)
    for i in range(nd, common.num_reqs):
        s, e, nc = common.query_start[i], common.query_end[i], common.num_computed[i]
        n_blocks = -(-(nc + e - s) // bs)
        md.prefills.append(PrefillSpan(s, e, nc, torch.tensor(block_ids[i][:n_blocks], dtype=torch.long)))
    return md


def build_running_state_metadata(common: CommonAttentionMetadata, block_ids: list[list[int]]
                                 ) -> RunningStateMetadata:
    nd = common.num_decodes
    return RunningStateMetadata(torch.tensor([ids[0] for ids in block_ids[:nd]], dtype=torch.long),
                                [ids[0] for ids in block_ids[nd:]], common.fresh[nd:],
                                [n > 0 for n in common.num_drafts[nd:]] if common.num_drafts
                                else [False] * (common.num_reqs - nd), nd,
                                list(zip(common.query_start[nd:], common.query_end[nd:])))


@dataclass
class ForwardContext:
    attn_metadata: list  # per KV cache group


_context: ForwardContext | None = None


@contextmanager
def set_forward_context(attn_metadata: list):
    global _context
    prev, _context = _context, ForwardContext(attn_metadata)
    try:
        yield
    finally:
        _context = prev


def get_forward_context() -> ForwardContext:
    if _context is None:
        raise RuntimeError("attention called outside a model-runner step")
    return _context

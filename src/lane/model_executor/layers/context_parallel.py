"""DSA context parallelism (``--enable-dsa-cp``, seed step 26): the seed's "slice attention's
input by sequence, gather before computing, scatter after, swap head ownership".

Tensor parallelism splits attention by heads: every rank attends every row with its heads.
For a sparse (DSA) layer in a step with a prefill chunk that makes each rank run the
lightning indexer and the top-k attention over every row. Under DSA context parallelism:

1. ``heads_to_rows``: the query, computed as before by heads (rank r: every row, its heads),
   goes through an all-to-all so each rank holds its share of the rows with every head
   (the rows sequence parallelism gives it: ``row_splits``).
2. Each rank gathers the context its rows need (their top-k entries from the latent cache,
   which every rank holds whole), runs the replicated indexer and attention for its rows.
3. ``rows_to_heads``: the outputs go back through an all-to-all to every row with this
   rank's heads, so the head-split output projection and its reduce are unchanged.

Decode-only steps stay split by heads (a decode row's attention is small; splitting rows
there would leave ranks idle). What attention needs per head for every head of a row (the
indexer, MLA's ``kv_b_proj``, V4's sinks) is replicated (``dsa_head_group``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lane import tracing
from lane.distributed.parallel_state import context_parallel_rows, get_tp_group
from lane.tracing import Step


@dataclass(frozen=True)
class RowWindow:
    """This rank's rows [lo, hi) of the step's flattened batch, and every rank's count."""
    lo: int
    hi: int
    splits: tuple[int, ...]

    def clip(self, start: int, end: int) -> tuple[int, int]:
        """Rows [start, end) of the batch (one request's) that are this rank's: [a, b), maybe empty."""
        a = max(start, self.lo)
        return a, max(a, min(end, self.hi))


def row_window(num_rows: int, has_prefill: bool) -> RowWindow | None:
    """The rows this rank attends in a step of ``num_rows`` rows: a window under DSA context
    parallelism when the step has a prefill chunk; None (split by heads) otherwise."""
    cp = context_parallel_rows(num_rows) if has_prefill else None
    if cp is None:
        return None
    lo, hi, splits = cp
    return RowWindow(lo, hi, tuple(splits))


def heads_to_rows(x: torch.Tensor, win: RowWindow) -> torch.Tensor:
    """[T, H_rank, d] (every row, this rank's heads) -> [rows, H, d] (this rank's rows, every
    head): one all-to-all (stage 1)."""
    tp = get_tp_group()
    T, h, d = x.shape
    got, _ = tp.all_to_all(x.reshape(T, h * d), list(win.splits), Step.COMM_CP_GATHER)
    n = win.hi - win.lo
    out = got.view(tp.world_size, n, h, d).transpose(0, 1).reshape(n, tp.world_size * h, d)
    tracing.forward_mark()(Step.COMM_CP_GATHER, stage="1 q heads->rows",
                           cp_rows_per_rank="/".join(map(str, win.splits)))
    return out


def rows_to_heads(y: torch.Tensor, win: RowWindow) -> torch.Tensor:
    """[rows, H, d] (this rank's rows, every head) -> [T, H_rank, d]: one all-to-all (stage 3)."""
    tp = get_tp_group()
    n, H, d = y.shape
    h = H // tp.world_size
    send = y.view(n, tp.world_size, h * d).transpose(0, 1).reshape(tp.world_size * n, h * d)
    got, _ = tp.all_to_all(send, [n] * tp.world_size, Step.COMM_CP_GATHER)
    tracing.forward_mark()(Step.COMM_CP_GATHER, stage="3 out rows->heads")
    return got.view(-1, h, d)


def mark_context_gathered(**attrs) -> None:
    """Stage 2: the context this rank's rows attend, gathered from the cache."""
    tracing.forward_mark()(Step.COMM_CP_GATHER, stage="2 context gathered", **attrs)

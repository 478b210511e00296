"""The process groups of one engine replica (seed step 2) and the handle the layers get
(step 5), as vLLM's ``parallel_state``: ``get_tp_group()`` / ``get_ep_group()`` return a
``GroupCoordinator`` whose collectives count calls, bytes and seconds per seed step, so
traces and ``benchmarks/parallel.py`` show what each all-reduce and gather costs.

On a CPU the groups are gloo's, and the ranks of one machine exchange tensors through a
shared-memory segment instead (``shm_comm.py``: tens of microseconds where gloo's loopback
TCP takes a millisecond); on CUDA, NCCL's. A replica's world is its tensor-parallel
ranks; the expert-parallel group is the same ranks (ep = tp) or no one (ep = 1).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import time
from dataclasses import dataclass

import torch

from lane import tracing


@dataclass
class CollectiveStats:
    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


class GroupCoordinator:
    """A group of ranks and its collectives. ``group`` None: a group of one, whose
    collectives return their input."""

    def __init__(self, name: str, ranks: list[int], rank: int, group=None, shm=None) -> None:
        self.name, self.ranks, self.group, self.shm = name, ranks, group, shm
        self.world_size = len(ranks)
        self.rank_in_group = ranks.index(rank) if rank in ranks else 0
        self.stats: dict[int, CollectiveStats] = {}  # seed step -> totals

    def _count(self, step: int, kind: str, nbytes: int, t0: float) -> None:
        dt = time.perf_counter() - t0
        s = self.stats.setdefault(int(step), CollectiveStats())
        s.calls, s.bytes, s.seconds = s.calls + 1, s.bytes + nbytes, s.seconds + dt
        prof = tracing.forward_profile()
        if prof is not None:
            prof.count(step, **{f"{kind}_bytes": nbytes, f"{kind}_ms": dt * 1e3, "collectives": 1})

    def all_reduce(self, x: torch.Tensor, step: int) -> torch.Tensor:
        """Sum x over the group, in place."""
        if self.world_size == 1:
            return x
        t0 = time.perf_counter()
        if self.shm is not None and self.shm.supports(x):
            self.shm.all_reduce(x)
        else:
            self._all_reduce_quiet(x)
        self._count(step, "allreduce", x.numel() * x.element_size(), t0)
        return x

    def all_gather(self, x: torch.Tensor, step: int, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated along ``dim`` (equal shapes)."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        t0 = time.perf_counter()
        x = x.contiguous()
        if self.shm is not None and self.shm.supports(x):
            parts = list(self.shm.all_gather(x).unbind(0))
        else:
            parts = [torch.empty_like(x) for _ in range(self.world_size)]
            dist.all_gather(parts, x, group=self.group)
        self._count(step, "allgather", x.numel() * x.element_size() * self.world_size, t0)
        return torch.cat(parts, dim=dim)

    def all_gather_rows(self, x: torch.Tensor, splits: list[int], step: int) -> torch.Tensor:
        """Every rank's rows (dim 0, ``splits[r]`` of them on rank r; they may differ by one)
        concatenated in rank order: the inverse of ``reduce_scatter``'s split."""
        if self.world_size == 1:
            return x
        most = max(splits)
        if x.shape[0] < most:  # equal shapes for the gather, the padding dropped after
            x = torch.cat([x, x.new_zeros((most - x.shape[0],) + tuple(x.shape[1:]))])
        whole = self.all_gather(x, step, dim=0)
        if all(n == most for n in splits):
            return whole
        return torch.cat([whole[r * most:r * most + n] for r, n in enumerate(splits)])

    def reduce_scatter(self, x: torch.Tensor, splits: list[int], step: int) -> torch.Tensor:
        """The sum over ranks of x's rows for this rank (dim 0 split as ``splits``: rank r gets
        ``splits[r]`` rows, starting after the ranks before it)."""
        if self.world_size == 1:
            return x
        t0 = time.perf_counter()
        if self.shm is not None and self.shm.supports(x):
            out = self.shm.reduce_scatter(x, splits)
        else:  # gloo has no reduce-scatter: the whole sum, then this rank's rows
            start = sum(splits[:self.rank_in_group])
            out = self._all_reduce_quiet(x.clone()).narrow(0, start, splits[self.rank_in_group]).clone()
        self._count(step, "reducescatter", x.numel() * x.element_size(), t0)
        return out

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], step: int) -> tuple[torch.Tensor, list[int]]:
        """Rows of x in rank order, ``send_counts[q]`` to rank q; returns the rows received (rank
        order) and how many came from each rank."""
        if self.world_size == 1:
            return x, list(send_counts)
        import torch.distributed as dist

        t0 = time.perf_counter()
        x = x.contiguous()
        if self.shm is not None and self.shm.supports(x):
            out, recv = self.shm.all_to_all(x, send_counts, group=self.group)
        else:
            counts = torch.tensor(send_counts, dtype=torch.int64)
            got = torch.empty_like(counts)
            dist.all_to_all_single(got, counts, group=self.group)
            recv = got.tolist()
            out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
            dist.all_to_all_single(out, x, recv, list(send_counts), group=self.group)
        self._count(step, "alltoall", x.numel() * x.element_size(), t0)
        return out, recv

    def _all_reduce_quiet(self, x: torch.Tensor) -> torch.Tensor:
        """gloo's all-reduce in place (half precision summed in float32: gloo reduces those
        slowly or not at all); not counted."""
        import torch.distributed as dist

        if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16):
            wide = x.float()
            dist.all_reduce(wide, group=self.group)
            return x.copy_(wide)
        dist.all_reduce(x, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor, step: int) -> torch.Tensor:
        """The group's first rank's x, in place on every rank."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        t0 = time.perf_counter()
        dist.broadcast(x, src=self.ranks[0], group=self.group)
        self._count(step, "broadcast", x.numel() * x.element_size(), t0)
        return x

    def take_stats(self) -> dict[int, CollectiveStats]:
        out, self.stats = self.stats, {}
        return out


@dataclass(frozen=True)
class ExpertPlacement:
    """How MoE layers lay out their experts: with EPLB, E + num_redundant_experts physical slots
    behind per-layer maps (eplb/placement.py); without, slot i is expert i."""
    eplb: bool = False
    num_redundant_experts: int = 0


def row_splits(num_rows: int, world: int) -> list[int]:
    """Rows per rank when ``num_rows`` are split over ``world`` ranks: equal shares, the first
    ``num_rows % world`` ranks one more (a rank may get none: a decode step of one row)."""
    return [num_rows // world + (1 if r < num_rows % world else 0) for r in range(world)]


@dataclass
class SequenceParallel:
    """Sequence parallelism (``--enable-sequence-parallel``): between attention and the FFN
    each tensor-parallel rank holds only its rows of the residual stream. ``splits``: the
    rows per rank of the forward under way (set at its start, ``begin``). ``step``: whether
    this step's forwards split their rows (the runner's choice, ``sequence_parallel_step``)."""
    enabled: bool = False
    splits: list[int] | None = None
    step: bool = True


_TP = GroupCoordinator("tp", [0], 0)
_EP = GroupCoordinator("ep", [0], 0)
_PLACEMENT = ExpertPlacement()
_SP = SequenceParallel()


_DSA_CP = False


def set_dsa_context_parallel(enabled: bool) -> None:
    """--enable-dsa-cp, for the indexers built next (every worker sets it before building)."""
    global _DSA_CP
    _DSA_CP = enabled


def dsa_context_parallel() -> bool:
    """DSA context parallelism: a prefill step's sparse attention is split by query rows over the
    tensor-parallel ranks instead of by heads (``layers/context_parallel.py``, step 26)."""
    return _DSA_CP and _TP.world_size > 1


def dsa_head_group() -> GroupCoordinator:
    """The ranks that a DSA layer's per-head pieces which attention needs for every head of a
    row (the lightning indexer, MLA's ``kv_b_proj``, V4's sinks) are split over: the
    tensor-parallel group, or under DSA context parallelism this rank alone (replicated)."""
    if dsa_context_parallel():
        return GroupCoordinator("tp", [_TP.ranks[_TP.rank_in_group]], _TP.ranks[_TP.rank_in_group])
    return _TP


def context_parallel_rows(num_rows: int) -> tuple[int, int, list[int]] | None:
    """Under DSA context parallelism, this rank's rows [lo, hi) of a step of ``num_rows`` rows
    (the split sequence parallelism uses) and every rank's count; None without it."""
    if not dsa_context_parallel():
        return None
    splits = row_splits(num_rows, _TP.world_size)
    lo = sum(splits[:_TP.rank_in_group])
    return lo, lo + splits[_TP.rank_in_group], splits


def set_sequence_parallel(enabled: bool) -> None:
    """What the model built next runs with (every worker sets it before building its model)."""
    _SP.enabled, _SP.splits = enabled, None


def sequence_parallel_enabled() -> bool:
    return _SP.enabled and _TP.world_size > 1


def sequence_parallel_step(split_rows: bool) -> None:
    """Whether the forwards of the coming step split their rows (the runner says, each step). A
    step with a prompt chunk does; one of decodes and drafts to verify, a few rows a request,
    keeps every row on every rank: one all-reduce a sublayer where the split costs a
    reduce-scatter and all-gathers, for rows too few to share out."""
    _SP.step = split_rows


def sequence_parallel_begin(num_rows: int) -> None:
    """A forward of ``num_rows`` rows starts: under sequence parallelism, set the rows each rank
    will hold (None: this step keeps them all)."""
    if sequence_parallel_enabled():
        _SP.splits = row_splits(num_rows, _TP.world_size) if _SP.step else None


def sequence_parallel_splits() -> list[int] | None:
    """The rows per rank of the forward under way; None without sequence parallelism."""
    return _SP.splits if sequence_parallel_enabled() else None


def get_tp_group() -> GroupCoordinator:
    return _TP


def get_ep_group() -> GroupCoordinator:
    return _EP


def get_expert_placement() -> ExpertPlacement:
    return _PLACEMENT


def set_expert_placement(placement: ExpertPlacement) -> None:
    """What the MoE layers built next read (every worker sets it before building its model)."""
    global _PLACEMENT
    _PLACEMENT = placement


@contextlib.contextmanager
def replica_local_experts():
    """MoE layers built inside spread their experts over this replica's ranks only, even under
    data-parallel attention (the MTP block: it runs a varying number of times a step, so its
    collectives must not involve other replicas, which run their own)."""
    global _EP
    saved = _EP
    if _EP.world_size > _TP.world_size:
        _EP = GroupCoordinator("ep", _TP.ranks, _TP.ranks[_TP.rank_in_group], _TP.group, _TP.shm)
    try:
        yield
    finally:
        _EP = saved


def set_model_parallel(tp: GroupCoordinator, ep: GroupCoordinator) -> None:
    """Step 5: the groups the layers read as they are built."""
    global _TP, _EP
    _TP, _EP = tp, ep


def init_distributed(world_size: int, rank: int, master_addr: str, master_port: int, timeout_s: float,
                     device: torch.device, expert_parallel: bool, tp_size: int | None = None
                     ) -> tuple[GroupCoordinator, GroupCoordinator]:
    """Step 2: join the world (TCP rendezvous at master_addr:master_port; gloo on a CPU, NCCL on
    CUDA). The world is one replica's tensor-parallel ranks, or, with data-parallel attention
    (``tp_size`` < ``world_size``), every replica's: ranks [d * tp, (d + 1) * tp) are replica d's
    tensor-parallel group and the experts spread over the whole world. Every collective gives up
    after ``timeout_s``: a rank that died or hangs fails the others instead of holding them
    forever. Returns the (TP, EP) groups."""
    import torch.distributed as dist

    if master_addr.startswith("127.") or master_addr == "localhost":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # a loopback world stays on loopback
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", world_size=world_size,
                            rank=rank, timeout=datetime.timedelta(seconds=timeout_s))
    tp_size = tp_size or world_size
    every = list(range(world_size))
    tp_ranks, tp_group = every, dist.group.WORLD
    if tp_size < world_size:  # every rank creates every replica's group, in the same order
        for first in range(0, world_size, tp_size):
            ranks = list(range(first, first + tp_size))
            group = dist.new_group(ranks, backend=backend) if tp_size > 1 else None
            if rank in ranks:
                tp_ranks, tp_group = ranks, group
    on_cpu = backend == "gloo"
    tp = GroupCoordinator("tp", tp_ranks, rank, tp_group, _shm(tp_group, tp_ranks, rank, timeout_s, on_cpu))
    if not expert_parallel:
        ep = GroupCoordinator("ep", [rank], rank)
    elif tp_size == world_size:
        ep = GroupCoordinator("ep", every, rank, dist.group.WORLD, tp.shm)
    else:
        ep = GroupCoordinator("ep", every, rank, dist.group.WORLD, _shm(dist.group.WORLD, every, rank, timeout_s, on_cpu))
    return tp, ep


def _shm(group, ranks: list[int], rank: int, timeout_s: float, on_cpu: bool):
    """The group's shared-memory communicator (None on CUDA, at one rank, or off one machine)."""
    if not on_cpu or len(ranks) == 1:
        return None
    from lane.distributed.shm_comm import ShmCommunicator

    return ShmCommunicator.create(group, len(ranks), ranks.index(rank), timeout_s)

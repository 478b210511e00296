"""Collectives between the ranks of one machine through a shared-memory segment (the C++ in
``csrc/shm_comm.cpp``; vLLM's CPU backend does the same), in place of gloo's loopback TCP:
an 8 KiB all-reduce costs tens of microseconds instead of about a millisecond.

A group gets one when every rank is on the same machine (same host name and boot id) and has
the compiled kernels; the decision is taken together over gloo, so no rank takes one path while
a peer takes the other. Rank 0 creates the segment (mode 0600 under ``/dev/shm``, its space
reserved up front so a full tmpfs is an error here, not a SIGBUS later), the others map it, and
it is unlinked as soon as all have: nothing is left behind when a process dies.
``LANE_SHM_COLLECTIVES=0`` keeps gloo. Tensors larger than a slot go through in slot-sized
chunks; an all-to-all whose largest send buffer exceeds a slot uses gloo (every rank knows
every rank's counts, so they all choose alike).
"""
from __future__ import annotations

import logging
import math
import mmap
import os
import socket
import tempfile

import torch

from lane.model_executor.layers import cpu_kernels

logger = logging.getLogger(__name__)

SHM_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int32: 3, torch.int64: 4}
DEFAULT_SLOT_BYTES = 2 << 20


class CollectiveError(RuntimeError):
    """A peer died or did not arrive within the timeout."""


def _host_id() -> int:
    """This machine (host name and boot): two ranks share memory only when both are equal."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    import hashlib

    return int.from_bytes(hashlib.sha256((socket.gethostname() + boot).encode()).digest()[:7], "little")


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class ShmCommunicator:
    """One group's segment and its collectives. Every rank of the group calls the same
    collectives in the same order (as with any process group)."""

    def __init__(self, path: str, world: int, rank: int, slot_bytes: int, timeout_s: float) -> None:
        """Map the segment at ``path`` (made by ``create_segment``) as rank ``rank``."""
        size = self.segment_bytes(world, slot_bytes)
        lib = cpu_kernels.native()
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._buf = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.base = self._buf.data_ptr()
        self.world, self.rank, self.slot_bytes, self.timeout_s = world, rank, slot_bytes, timeout_s
        self._seq = 0
        self._status = torch.zeros(2, dtype=torch.int32)
        self._lib = lib
        lib.lane_shm_attach(self.base, rank, os.getpid())

    @staticmethod
    def segment_bytes(world: int, slot_bytes: int) -> int:
        layout = torch.zeros(2, dtype=torch.int64)
        if not cpu_kernels.build():
            raise RuntimeError("shared-memory segments need the compiled CPU kernels (a C++ compiler)")
        cpu_kernels.native().lane_shm_layout(world, slot_bytes, layout.data_ptr())
        return int(layout[1])

    @classmethod
    def create_segment(cls, world: int, slot_bytes: int) -> str:
        """A new 0600 segment for ``world`` ranks that other processes attach to by its path
        (``ShmCommunicator(path, ...)``); the creator unlinks it once they have. Its space is
        reserved now: a full tmpfs is an error here, not a SIGBUS at the first touch."""
        fd, path = tempfile.mkstemp(prefix="lane-shm-", dir=_shm_dir())
        try:
            os.posix_fallocate(fd, 0, cls.segment_bytes(world, slot_bytes))
        finally:
            os.close(fd)
        return path

    @classmethod
    def create(cls, group, world: int, rank: int, timeout_s: float) -> ShmCommunicator | None:
        """Collective over the gloo ``group``: a communicator on every rank, or None on every rank."""
        import torch.distributed as dist

        want = os.environ.get("LANE_SHM_COLLECTIVES", "1") != "0" and cpu_kernels.build()
        me = torch.tensor([int(want), _host_id()], dtype=torch.int64)
        everyone = [torch.empty_like(me) for _ in range(world)]
        dist.all_gather(everyone, me, group=group)
        if not all(int(t[0]) for t in everyone) or len({int(t[1]) for t in everyone}) != 1:
            return None
        slot_bytes = int(os.environ.get("LANE_SHM_SLOT_BYTES", DEFAULT_SLOT_BYTES))
        name = torch.zeros(256, dtype=torch.uint8)
        comm = None
        if rank == 0:
            try:
                path = cls.create_segment(world, slot_bytes)
                comm = cls(path, world, rank, slot_bytes, timeout_s)
                raw = path.encode()
                name[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
            except OSError as e:
                logger.warning("shared-memory collectives unavailable (%s); using gloo", e)
        dist.broadcast(name, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        path = bytes(name[name != 0].tolist()).decode()
        ok = torch.tensor([1 if path else 0], dtype=torch.int64)
        if path and rank != 0:
            try:
                comm = cls(path, world, rank, slot_bytes, timeout_s)
            except OSError as e:
                logger.warning("shared-memory segment %s not mapped (%s); using gloo", path, e)
                ok.zero_()
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
        if rank == 0 and path:
            os.unlink(path)  # every rank holds its mapping: the name is no longer needed
        return comm if int(ok) else None

    # one sequence number per C++ call; the C++ raises nothing, it reports in _status
    def _next(self) -> int:
        self._seq += 1
        return self._seq

    def _check(self, what: str) -> None:
        code, peer = int(self._status[0]), int(self._status[1])
        if code:
            self._status.zero_()
            why = "exited" if code == 2 else f"did not arrive within {self.timeout_s:g} s"
            raise CollectiveError(f"shared-memory {what}: rank {peer} of {self.world} {why}")

    def supports(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in SHM_DTYPES

    def barrier(self) -> None:
        self._lib.lane_shm_barrier(self.base, self.world, self.rank, self._next(), self.timeout_s,
                                   self._status.data_ptr())
        self._check("barrier")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (float sums in float32, rounded once)."""
        flat = x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)
        per = self.slot_bytes // flat.element_size()
        code, size = SHM_DTYPES[x.dtype], flat.element_size()
        for lo in range(0, flat.numel(), per):
            n = min(per, flat.numel() - lo)
            p = flat.data_ptr() + lo * size
            self._lib.lane_shm_all_reduce(self.base, self.world, self.rank, self.slot_bytes, self._next(), p, p, n,
                                          code, size, self.timeout_s, self._status.data_ptr())
            self._check("all_reduce")
        if flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view_as(x))
        return x

    def reduce_scatter(self, x: torch.Tensor, splits: list[int]) -> torch.Tensor:
        """The sum over ranks of this rank's rows of x (dim 0, ``splits[r]`` rows for rank r)."""
        x = x.contiguous()
        row = math.prod(x.shape[1:])
        starts = [sum(splits[:r]) for r in range(self.world + 1)]
        out = x.new_empty((splits[self.rank],) + tuple(x.shape[1:]))
        flat, size = x.view(-1), x.element_size()
        mine_lo, mine_hi = starts[self.rank] * row, starts[self.rank + 1] * row
        per = self.slot_bytes // size
        code = SHM_DTYPES[x.dtype]
        for lo in range(0, max(flat.numel(), 1), per):
            n = min(per, flat.numel() - lo)
            a, b = max(mine_lo, lo), min(mine_hi, lo + n)
            dst = out.data_ptr() + max(0, a - mine_lo) * size
            self._lib.lane_shm_reduce_scatter(self.base, self.world, self.rank, self.slot_bytes, self._next(),
                                              flat.data_ptr() + lo * size, n, a - lo, max(a, b) - lo, dst, code,
                                              size, self.timeout_s, self._status.data_ptr())
            self._check("reduce_scatter")
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[world, *x.shape]: every rank's x (equal shapes), in rank order."""
        x = x.contiguous()
        out = x.new_empty((self.world,) + tuple(x.shape))
        nbytes = x.numel() * x.element_size()
        for lo in range(0, max(nbytes, 1), self.slot_bytes):
            n = min(self.slot_bytes, nbytes - lo)
            self._lib.lane_shm_all_gather(self.base, self.world, self.rank, self.slot_bytes, self._next(),
                                          x.data_ptr() + lo, n, out.data_ptr() + lo, nbytes, self.timeout_s,
                                          self._status.data_ptr())
            self._check("all_gather")
        return out

    def all_to_all(self, x: torch.Tensor, send_counts: list[int], group=None) -> tuple[torch.Tensor, list[int]]:
        """Rows [sum(send_counts[:q]), +send_counts[q]) of x go to rank q; returns what this rank
        received (rank order) and how many rows from each rank."""
        x = x.contiguous()
        counts = torch.tensor(send_counts, dtype=torch.int64)
        table = self.all_gather(counts)  # [sender, receiver] rows
        row_bytes = math.prod(x.shape[1:]) * x.element_size()
        recv = table[:, self.rank].tolist()
        out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
        if int(table.sum(1).max()) * row_bytes > self.slot_bytes:  # every rank sees the same table
            import torch.distributed as dist

            dist.all_to_all_single(out, x, recv, list(send_counts), group=group)
            return out, recv
        offs = (table.cumsum(1) - table)[:, self.rank] * row_bytes
        lens = table[:, self.rank] * row_bytes
        self._lib.lane_shm_all_to_all(self.base, self.world, self.rank, self.slot_bytes, self._next(), x.data_ptr(),
                                      x.numel() * x.element_size(), offs.data_ptr(), lens.data_ptr(), out.data_ptr(),
                                      self.timeout_s, self._status.data_ptr())
        self._check("all_to_all")
        return out, recv

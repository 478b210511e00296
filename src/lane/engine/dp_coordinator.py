"""Data-parallel replicas in lock-step (data-parallel attention with wide expert parallelism),
and the seed's balance scheduler (DPLB, steps 13 and 15).

Under ``-dp N --enable-expert-parallel`` every MoE layer's all-to-all spans every replica's
ranks, so every replica must run a forward whenever any does. Before each step the engine cores
all-gather a row each, through a shared-memory segment the API server made for them:
(has work, running, waiting, at cap, tokens scheduled last step). If nobody has work they wait
for requests (polling, so a request arriving at one replica wakes all within ``poll_s``); else
every replica steps, one with nothing to schedule running a dummy batch so the collectives meet.

The balance: while any replica is at its cap (running = --max-num-seqs) no replica admits new
requests this step (the seed's BalanceScheduler), so lock-stepped replicas do not wait on one
overloaded peer while the others take on more. ``imbalance``: over the last ``window`` steps with
work, the most tokens any replica scheduled over the mean (``lane:dp_imbalance``).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from lane.metrics.stats import DPStats

SLOT_BYTES = 4096


@dataclass
class DPRound:
    """What every replica agreed on before a step."""
    any_work: bool
    frozen: bool  # some replica is at its cap: nobody admits this step
    running: list[int]
    waiting: list[int]


def create_segment(dp_size: int) -> str:
    """The API server's side: a 0600 segment for ``dp_size`` engine cores (they attach to it)."""
    from lane.distributed.shm_comm import ShmCommunicator

    return ShmCommunicator.create_segment(dp_size, SLOT_BYTES)


class DPCoordinator:
    def __init__(self, path: str, dp_size: int, dp_rank: int, max_num_seqs: int, timeout_s: float,
                 poll_s: float = 0.005, window: int = 64) -> None:
        from lane.distributed.shm_comm import ShmCommunicator

        self.comm = ShmCommunicator(path, dp_size, dp_rank, SLOT_BYTES, timeout_s)
        self.max_num_seqs, self.poll_s = max_num_seqs, poll_s
        self._scheduled: deque[torch.Tensor] = deque(maxlen=window)  # the window's steps with work
        self._window_total = torch.zeros(dp_size, dtype=torch.int64)  # their sum, kept as they come and go
        self.stats = DPStats(running=[0] * dp_size)

    def sync(self, has_work: bool, running: int, waiting: int, scheduled_last: int) -> DPRound:
        """Every replica calls this once a loop turn, in the same order."""
        me = torch.tensor([int(has_work), running, waiting, int(running >= self.max_num_seqs), scheduled_last],
                          dtype=torch.int64)
        table = self.comm.all_gather(me)  # [dp, 5]
        if int(table[:, 4].sum()):
            if len(self._scheduled) == self._scheduled.maxlen:
                self._window_total -= self._scheduled[0]
            self._scheduled.append(table[:, 4].clone())
            self._window_total += self._scheduled[-1]
            total = self._window_total.double()
            self.stats.imbalance = float(total.max() / total.mean())
        rnd = DPRound(bool(table[:, 0].any()), bool(table[:, 3].any()), table[:, 1].tolist(), table[:, 2].tolist())
        if rnd.any_work:
            self.stats.steps += 1
            self.stats.frozen_steps += rnd.frozen
        self.stats.running = rnd.running
        return rnd



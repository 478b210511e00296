"""Data-parallel load balancing (seed step 13), as vLLM's DPLBAsyncMPClient does it.

Each engine publishes its running and waiting counts with every output batch.
A new request goes to the engine with the lowest score, waiting x 4 + running;
the counts lag behind the sends, so each send bumps the chosen engine's waiting
count at once (until its next stats overwrite it). A request may pin an engine
with ``data_parallel_rank``.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineLoad:
    waiting: int = 0
    running: int = 0
    alive: bool = True

    @property
    def score(self) -> int:
        return self.waiting * 4 + self.running


class DPLoadBalancer:
    def __init__(self, num_engines: int) -> None:
        self.loads = [EngineLoad() for _ in range(num_engines)]

    def choose(self, data_parallel_rank: int | None = None, num_requests: int = 1) -> int:
        """The engine for a new request (of num_requests engine requests, n > 1 fans out)."""
        if data_parallel_rank is not None:
            if not 0 <= data_parallel_rank < len(self.loads):
                raise ValueError(f"data_parallel_rank must be in [0, {len(self.loads)}), "
                                 f"got {data_parallel_rank}")
            if not self.loads[data_parallel_rank].alive:
                raise RuntimeError(f"engine {data_parallel_rank} is not running")
            index = data_parallel_rank
        else:
            live = [i for i, load in enumerate(self.loads) if load.alive]
            if not live:
                raise RuntimeError("no engine is running")
            index = min(live, key=lambda i: (self.loads[i].score, i))
        self.loads[index].waiting += num_requests
        return index

    def update(self, engine_index: int, waiting: int, running: int) -> None:
        load = self.loads[engine_index]
        load.waiting, load.running = waiting, running

    def mark_dead(self, engine_index: int) -> None:
        self.loads[engine_index].alive = False

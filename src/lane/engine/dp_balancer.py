"""Data-parallel load balancing (seed step 13), as vLLM's DPLBAsyncMPClient does it,
and the bound on waiting requests that turns overload into refusals.

Each engine publishes its running and waiting counts with every output batch.
A new request goes to the engine with the lowest score, waiting x 4 + running;
the counts lag behind the sends, so each send bumps the chosen engine's waiting
count at once (until its next stats overwrite it). A request may pin an engine
with ``data_parallel_rank``.

With a bound on waiting requests (per engine: each engine has its own queue, as
each has its own --max-num-seqs), a request goes only to an engine with room for
it; when no engine it may go to has room, it is refused and never sent.
"""
from __future__ import annotations

from dataclasses import dataclass


class EngineOverloadedError(RuntimeError):
    """No engine a request may go to has room for it in its waiting queue."""

    def __init__(self, engine_index: int, waiting: int, limit: int) -> None:
        super().__init__(f"the server is overloaded: engine {engine_index} already has {waiting} requests "
                         f"waiting (at most {limit}); retry later")
        self.engine_index, self.waiting, self.limit = engine_index, waiting, limit


@dataclass
class EngineLoad:
    waiting: int = 0
    running: int = 0
    alive: bool = True

    @property
    def score(self) -> int:
        return self.waiting * 4 + self.running


class DPLoadBalancer:
    def __init__(self, num_engines: int, max_waiting: int | None = None) -> None:
        if max_waiting is not None and max_waiting < 1:
            raise ValueError(f"--max-num-waiting-requests must be >= 1, got {max_waiting}")
        self.loads = [EngineLoad() for _ in range(num_engines)]
        self.max_waiting = max_waiting

    def choose(self, data_parallel_rank: int | None = None, num_requests: int = 1) -> int:
        """The engine for a new request (of num_requests engine requests, n > 1 fans out).
        Raises EngineOverloadedError when no engine it may go to has room for it."""
        if data_parallel_rank is not None:
            if not 0 <= data_parallel_rank < len(self.loads):
                raise ValueError(f"data_parallel_rank must be in [0, {len(self.loads)}), "
                                 f"got {data_parallel_rank}")
            if not self.loads[data_parallel_rank].alive:
                raise RuntimeError(f"engine {data_parallel_rank} is not running")
            candidates = [data_parallel_rank]
        else:
            candidates = [i for i, load in enumerate(self.loads) if load.alive]
            if not candidates:
                raise RuntimeError("no engine is running")

        def rank(i: int) -> tuple[int, int]:
            return self.loads[i].score, i

        roomy = [i for i in candidates
                 if self.max_waiting is None or self.loads[i].waiting + num_requests <= self.max_waiting]
        if not roomy:
            best = min(candidates, key=rank)
            raise EngineOverloadedError(best, self.loads[best].waiting, self.max_waiting)
        index = min(roomy, key=rank)
        self.loads[index].waiting += num_requests
        return index

    def release(self, engine_index: int, num_requests: int) -> None:
        """Undo a choice whose request was not sent after all."""
        load = self.loads[engine_index]
        load.waiting = max(load.waiting - num_requests, 0)

    def update(self, engine_index: int, waiting: int, running: int) -> None:
        load = self.loads[engine_index]
        load.waiting, load.running = waiting, running

    def mark_dead(self, engine_index: int) -> None:
        self.loads[engine_index].alive = False

"""How an engine reaches its workers: in its own process (one rank), one process per rank
(``MultiprocExecutor``, on one machine or several), or Ray actors (``RayExecutor``)."""
from lane.executor.abstract import Executor

__all__ = ["Executor"]

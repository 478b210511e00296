"""The event loop the API server and ``lane bench`` run on: uvloop where it is installed (a
dependency on Linux), else asyncio's own.

At 64 streams the API server's CPU per streamed token is mostly event-loop and HTTP work, taken
from the two cores the engine computes on: with uvloop, and uvicorn's httptools parser (picked
by itself once installed), ``benchmarks/serving.py``'s 64-stream output rose 2-3 % and the mean
TTFT fell 6 % (Sapphire Rapids, 2 cores)."""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on uvloop where it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)

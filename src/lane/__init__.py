"""lane: an LLM serving engine that shows every step of a request's path."""
from __future__ import annotations

import importlib

from lane.logger import configure_logging

configure_logging()

__version__ = "0.1.0"

# the package's exports, each imported on first use: `import lane.bench.benchmark` (or
# any light submodule) loads no torch, and LLM's model code loads only when it is used
_EXPORTS = {
    "LLM": "lane.engine.llm",
    "ModelRegistry": "lane.registry",
    "SamplingParams": "lane.sampling_params",
    "RequestOutput": "lane.outputs",
    "CompletionOutput": "lane.outputs",
    "Logprob": "lane.outputs",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # found directly from now on
        return value
    raise AttributeError(f"module 'lane' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = ["LLM", "SamplingParams", "ModelRegistry", "RequestOutput", "CompletionOutput", "Logprob"]

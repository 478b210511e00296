"""lane: an LLM serving engine that shows every step of a request's path."""
from lane.logger import configure_logging

configure_logging()

from lane.registry import ModelRegistry
from lane.sampling_params import SamplingParams
from lane.outputs import CompletionOutput, Logprob, RequestOutput

__version__ = "0.1.0"


def __getattr__(name):
    # LLM pulls in torch model code: import it on first use only
    if name == "LLM":
        from lane.engine.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "ModelRegistry", "RequestOutput", "CompletionOutput", "Logprob"]

"""StructuredOutputManager (engine core, vLLM's name): grammars compiled for the model's
tokenizer in a worker thread, so a compile never stalls the running batch (the request
waits for its grammar, the others keep decoding); compiled grammars cached by spec (LRU);
one matcher per request, advanced with every token the request keeps; each step's token
bitmask (int32, a bit per vocabulary entry) for the requests that sample."""
from __future__ import annotations

import logging
import sys
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from lane.sampling_params import StructuredOutputsParams
from lane.structured_output import grammar_of

logger = logging.getLogger(__name__)


class StructuredOutputManager:
    def __init__(self, tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: list[int],
                 cache_size: int = 128) -> None:
        """``tokenizer``: a function that makes it (it is loaded in the compile thread)."""
        self.vocab_size = vocab_size
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        # the tokenizer tables (loading the tokenizer, importing xgrammar, its TokenizerInfo: ~1 s
        # for a 49k vocabulary) are built in the compile thread, first: the engine loop that made
        # this manager keeps stepping the other requests meanwhile
        self.tables: Future = self.pool.submit(self._build_tables, tokenizer, vocab_size, eos_token_ids)
        self.cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.cache_size = cache_size
        self.matchers: dict[str, object] = {}  # request id -> GrammarMatcher
        # requests still reasoning: request id -> (the end marker's ids, the last tokens seen)
        self.reasoning: dict[str, tuple[list[int], list[int]]] = {}
        self.pending: dict[str, tuple[tuple[str, str], Future]] = {}  # request id -> (spec, its compile)
        self.compile_seconds: dict[tuple[str, str], float] = {}

    def _build_tables(self, tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: list[int]) -> None:
        # mostly Python holding the GIL: the engine loop, which hands the GIL over at every torch
        # op, would wait up to a switch interval (5 ms) to get it back each time; shorter meanwhile
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, 0.0002))
        try:
            import xgrammar as xgr

            self._xgr = xgr
            self.info = xgr.TokenizerInfo.from_huggingface(tokenizer(), vocab_size=vocab_size,
                                                           stop_token_ids=list(eos_token_ids) or None)
            self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        finally:
            sys.setswitchinterval(interval)

    # -- grammars ------------------------------------------------------------------
    def _compile(self, params: StructuredOutputsParams):
        import time

        self.tables.result()  # built before any compile (the same thread); raises if they failed
        t0 = time.perf_counter()
        compiled = self.compiler.compile_grammar(grammar_of(params))
        self.compile_seconds[params.key] = time.perf_counter() - t0
        return compiled

    def submit(self, request_id: str, params: StructuredOutputsParams) -> None:
        """Start (or reuse) the compile of a request's grammar."""
        key = params.key
        fut = self.cache.get(key)
        if fut is None:
            fut = self.cache[key] = self.pool.submit(self._compile, params)
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        else:
            self.cache.move_to_end(key)
        self.pending[request_id] = (key, fut)
        if params.reasoning_end:
            self.reasoning[request_id] = (list(params.reasoning_end), [])

    def constrains(self, request_id: str) -> bool:
        """Whether the request's next token is constrained (not while it is still reasoning)."""
        return request_id not in self.reasoning

    def ready(self, request_id: str) -> bool:
        """Whether the request's grammar is compiled (its matcher then exists)."""
        entry = self.pending.get(request_id)
        if entry is None:
            return True
        key, fut = entry
        if not fut.done():
            return False
        if (e := fut.exception()) is not None:
            # never cached: the next request with this spec compiles it again. The request stays
            # pending (it must not run unconstrained); the API server and LLM check every spec
            # before queueing, so only a compile that fails where its check passed gets here
            if self.cache.get(key) is fut:
                del self.cache[key]
            raise ValueError(f"request {request_id}: its structured outputs grammar failed to compile: {e}") from e
        del self.pending[request_id]
        self.matchers[request_id] = self._xgr.GrammarMatcher(fut.result())
        return True

    # -- per step ------------------------------------------------------------------
    def bitmask(self, request_ids: list[str]) -> np.ndarray:
        """[len(request_ids), ceil(V / 32)] int32: the tokens each request may sample next."""
        mask = self._xgr.allocate_token_bitmask(len(request_ids), self.vocab_size)
        for row, rid in enumerate(request_ids):
            self.matchers[rid].fill_next_token_bitmask(mask, row)
        return mask.numpy()

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher; True once its grammar is complete (it then stops)."""
        if (thinking := self.reasoning.get(request_id)) is not None:  # free until the marker ends
            end, tail = thinking
            tail.append(token_id)
            del tail[:-len(end)]
            if tail == end:
                del self.reasoning[request_id]
            return False
        m = self.matchers.get(request_id)
        if m is None:
            return False
        if not m.accept_token(token_id):
            logger.warning("request %s: token %d does not fit its grammar", request_id, token_id)
        return m.is_terminated()

    def finish(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)
        self.pending.pop(request_id, None)
        self.reasoning.pop(request_id, None)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


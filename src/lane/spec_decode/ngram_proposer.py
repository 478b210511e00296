"""n-gram prompt lookup (vLLM's ``NgramProposer``): the longest suffix of a request's own
tokens (prompt and output) that occurred before, ``prompt_lookup_min`` .. ``prompt_lookup_max``
tokens long, proposes the tokens that followed its latest earlier occurrence: up to ``k``,
never past ``max_model_len``. A request with no match gets no drafts (and costs one scan)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclass
class NgramProposer:
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")

    def propose(self, token_ids: list[int] | np.ndarray) -> list[int]:
        tokens = np.asarray(token_ids, dtype=np.int64)
        L = len(tokens)
        k = self.num_speculative_tokens
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - L)
        if k <= 0:
            return []
        for n in range(min(self.prompt_lookup_max, L - 1), self.prompt_lookup_min - 1, -1):
            # earlier windows of n tokens, each followed by at least one token
            windows = sliding_window_view(tokens[:L - 1], n)
            hits = np.flatnonzero((windows == tokens[L - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest occurrence's continuation
                return tokens[start:start + k].tolist()
        return []

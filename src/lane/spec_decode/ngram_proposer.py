"""n-gram prompt lookup (vLLM's ``NgramProposer``): the longest suffix of a request's own
tokens (prompt and output) that occurred before, ``prompt_lookup_min`` .. ``prompt_lookup_max``
tokens long, proposes the tokens that followed its latest earlier occurrence: up to ``k``,
never past ``max_model_len``. A request with no match gets no drafts (and costs one scan)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
        if k <= 0 or L < 2:
            return []
        # earlier positions that end a match of the last token (each followed by a token),
        # narrowed one token further back at a time: a few array ops, whatever the length
        ends = np.flatnonzero(tokens[:L - 1] == tokens[L - 1])
        n = 1
        while ends.size and n < min(self.prompt_lookup_max, L - 1):
            longer = ends[ends >= n]
            longer = longer[tokens[longer - n] == tokens[L - 1 - n]]
            if not longer.size:
                break
            ends, n = longer, n + 1
        if not ends.size or n < self.prompt_lookup_min:
            return []
        start = int(ends[-1]) + 1  # the latest occurrence's continuation
        return tokens[start:start + k].tolist()

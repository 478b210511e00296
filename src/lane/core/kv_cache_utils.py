"""Block hashes for the prefix cache, and sizing the pools from the layers' specs (seed
step 8), shared by the worker and ``lane explain``.

One pool per KV cache group. Running-state groups get one slot per running request
(+ slot 0, never handed out). A sliding-window group gets what every running request's
window can hold at once, but at most half the budget and never less than one request
needs (past that, requests are preempted as for the main pool). The full group, the
main pool, gets the rest of the budget.
"""
from __future__ import annotations

import hashlib
import struct

from lane.kv_cache_interface import FULL, SLIDING_WINDOW, STATE, KVCacheConfig, KVCacheGroupSpec


def hash_block_tokens(parent: bytes | None, token_ids: list[int] | tuple[int, ...],
                      extra_keys: tuple = ()) -> bytes:
    """A full block's hash: chained over its parent, so equal prefixes hash equal."""
    h = hashlib.sha256(parent or b"\0")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def window_blocks_needed(window: int, block_size: int, max_num_seqs: int,
                         max_num_batched_tokens: int) -> tuple[int, int]:
    """(the most, the fewest) window blocks worth having (+ the null block): every running
    request's window plus one step's chunks; and one request's window plus a full chunk,
    without which a long prompt could never be scheduled."""
    per_request = -(-(window - 1) // block_size) + 1
    chunk = -(-max_num_batched_tokens // block_size) + 1
    return max_num_seqs * per_request + chunk + max_num_seqs + 1, per_request + chunk + 1


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Main-pool blocks for one request of ``num_tokens`` tokens, the null block included."""
    return -(-num_tokens // block_size) + 1


def get_kv_cache_config(groups: list[KVCacheGroupSpec], budget: int, max_num_seqs: int,
                        max_num_batched_tokens: int, max_model_len: int | None) -> KVCacheConfig:
    """Blocks per group for ``budget`` bytes; raises when one request of ``max_model_len``
    does not fit the main pool (None: no check). Running state is per request, not per token: it is
    allocated besides the budget (a few KiB per request)."""
    if sum(g.kind == FULL for g in groups) != 1:
        raise ValueError(f"a model needs exactly one full-attention KV cache group, got "
                         f"{[g.kind for g in groups]}")

    def window_pool(g: KVCacheGroupSpec, b: int) -> int:
        """Blocks of a sliding-window group's pool at budget ``b`` (not fewer as b grows)."""
        most, fewest = window_blocks_needed(g.sliding_window, g.block_size, max_num_seqs,
                                            max_num_batched_tokens)
        return max(fewest, min(most, b // 2 // g.page_size_bytes))

    def window_bytes(b: int) -> int:
        return sum(window_pool(g, b) * g.page_size_bytes for g in groups if g.kind == SLIDING_WINDOW)

    # state slots and window pools first; the full group (the main pool) gets what they leave
    num_blocks = [0] * len(groups)
    for i, g in enumerate(groups):
        if g.kind == STATE:
            num_blocks[i] = max_num_seqs + 1
        elif g.kind == SLIDING_WINDOW:
            num_blocks[i] = window_pool(g, budget)
    window = window_bytes(budget)
    main = [g.kind for g in groups].index(FULL)
    per_block = groups[main].page_size_bytes
    num_blocks[main] = max(0, budget - window) // per_block if per_block else 0
    block_size = groups[main].block_size
    need = blocks_needed(max_model_len, block_size) if max_model_len else 0
    if num_blocks[main] < need:
        # the least budget whose main pool holds `need` blocks: a larger budget also enlarges
        # the window pools, so iterate to the fixed point (window_bytes does not decrease)
        least = need * per_block
        while need * per_block + window_bytes(least) > least:
            least = need * per_block + window_bytes(least)
        raise ValueError(
            f"KV cache budget {budget / 2**20:.1f} MiB holds {num_blocks[main]} blocks of "
            f"{block_size} tokens ({per_block} B each"
            + (f", after {window} B for the sliding-window pool" if window else "")
            + f"), but one request of max_model_len {max_model_len} needs {need}; raise "
            f"--kv-cache-memory-bytes to at least {least} or lower --max-model-len")
    return KVCacheConfig(groups, num_blocks)

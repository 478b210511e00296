"""Sizing the KV pools (seed step 8), shared by the worker and `lane explain`.

Models whose layers keep a sliding window of raw tokens (DeepSeek V4) get a second,
small pool for it: a running request holds at most the blocks its window spans plus
its current prefill chunk; older window blocks are released (``SlidingWindowBlocks``
in ``kv_cache_manager.py``). Everything else lives in the main pool.
"""
from __future__ import annotations

from dataclasses import dataclass


def window_blocks_needed(window: int, block_size: int, max_num_seqs: int,
                         max_num_batched_tokens: int) -> tuple[int, int]:
    """(the most, the fewest) window blocks worth having (+ the null block): every running
    request's window plus one step's chunks; and one request's window plus a full chunk,
    without which a long prompt could never be scheduled."""
    per_request = -(-(window - 1) // block_size) + 1
    chunk = -(-max_num_batched_tokens // block_size) + 1
    return max_num_seqs * per_request + chunk + max_num_seqs + 1, per_request + chunk + 1


@dataclass
class KVPoolPlan:
    num_blocks: int  # main pool, the null block included
    num_window_blocks: int  # window pool, the null block included (0: no window pool)
    bytes_per_block: int  # main pool
    bytes_per_window_block: int

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block + self.num_window_blocks * self.bytes_per_window_block


def plan_kv_pools(budget: int, bytes_per_block: int, bytes_per_window_block: int = 0,
                  window_blocks: tuple[int, int] = (0, 0)) -> KVPoolPlan:
    """The window pool first: what every running request could need, but at most half
    the budget (and never below what one request needs; past that, running requests
    are preempted as for the main pool). The rest of the budget goes to the main pool."""
    n_window = 0
    if bytes_per_window_block:
        most, fewest = window_blocks
        n_window = max(fewest, min(most, budget // 2 // bytes_per_window_block))
    rest = max(0, budget - n_window * bytes_per_window_block)
    return KVPoolPlan(rest // bytes_per_block if bytes_per_block else 0, n_window, bytes_per_block,
                      bytes_per_window_block)

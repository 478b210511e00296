"""One manager per KV cache group, by the group's kind (vLLM's
``single_type_kv_cache_manager.py``): each keeps its group's pool and every request's
table of blocks in it.

- ``FullAttentionManager``: a request holds every block of its context.
- ``SlidingWindowManager``: blocks no future query can see (they end before the next
  query's window) are released: back to the free queue or, hashed, findable by the
  prefix cache until evicted; their table slot becomes the null block.
- ``RunningStateManager``: one slot per running request (its "table" is that one slot),
  like a Mamba state; slot 0 is never handed out.
"""
from __future__ import annotations

from lane.core.block_pool import BlockPool, KVCacheBlock
from lane.kv_cache_interface import FULL, SLIDING_WINDOW, STATE, KVCacheGroupSpec


class SingleTypeKVCacheManager:
    def __init__(self, group: KVCacheGroupSpec, num_blocks: int, enable_caching: bool) -> None:
        self.group = group
        self.block_size = group.block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # leading blocks of each request already registered in the prefix cache
        self.num_cached_block: dict[str, int] = {}

    def _held(self, blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
        return [b for b in blocks if b is not self.pool.null_block]

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix-cache hits ------------------------------------------------------
    def find_longest_cache_hit(self, block_hashes: list[bytes], max_num_blocks: int
                               ) -> tuple[int, list[KVCacheBlock]]:
        """(n, blocks): the longest hit of at most ``max_num_blocks`` full blocks this
        group can serve, and its blocks for the request's table."""
        hit: list[KVCacheBlock] = []
        for h in block_hashes[:max_num_blocks]:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            hit.append(b)
        return len(hit), hit

    # -- allocation -------------------------------------------------------------
    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: list[KVCacheBlock], num_skipped_tokens: int = 0) -> int:
        """Blocks to take from the free queue: new ones, and cached hits that sit in it."""
        have = len(self.req_to_blocks.get(request_id, ())) + len(new_computed_blocks)
        have = max(have, self._num_skipped_blocks(num_skipped_tokens))
        return (max(self._num_blocks_for(num_tokens) - have, 0)
                + sum(1 for b in self._held(new_computed_blocks) if b.ref_cnt == 0))

    def _num_skipped_blocks(self, num_skipped_tokens: int) -> int:
        """Leading blocks of computed tokens this group need not hold (only a window has any)."""
        return 0

    def save_new_computed_blocks(self, request_id: str, blocks: list[KVCacheBlock]) -> None:
        table = self.req_to_blocks.setdefault(request_id, [])
        if blocks:
            self.pool.touch(self._held(blocks))
            table.extend(blocks)
            self.num_cached_block[request_id] = len(table)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_skipped_tokens: int = 0
                            ) -> list[KVCacheBlock]:
        table = self.req_to_blocks.setdefault(request_id, [])
        skipped = self._num_skipped_blocks(num_skipped_tokens)
        if len(table) < skipped:  # transferred tokens outside the window: null blocks, never slots
            table.extend([self.pool.null_block] * (skipped - len(table)))
        new = self.pool.get_new_blocks(max(self._num_blocks_for(num_tokens) - len(table), 0))
        table.extend(new)
        return new

    def cache_blocks(self, request_id: str, block_hashes: list[bytes], num_full_blocks: int) -> None:
        """Register the request's newly full blocks (hashes already computed)."""
        table = self.req_to_blocks.get(request_id)
        if not table or not self.pool.enable_caching:
            return
        num_full = min(num_full_blocks, len(table))
        start = self.num_cached_block.get(request_id, 0)
        for i in range(start, num_full):
            if table[i] is not self.pool.null_block:
                self.pool.cache_block(table[i], block_hashes[i])
        self.num_cached_block[request_id] = max(start, num_full)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Release blocks no future query can see (only a sliding window has any)."""

    def free_tail(self, request_id: str, num_tokens: int) -> int:
        """Free the blocks past those ``num_tokens`` tokens need. Never cached (not yet full of
        verified tokens), they go to the free queue's head, in table order: the next
        allocation takes them back before it evicts a cached block. Returns how many."""
        table = self.req_to_blocks.get(request_id)
        keep = self._num_blocks_for(num_tokens)
        if not table or len(table) <= keep:
            return 0
        tail = table[keep:]
        del table[keep:]
        self.pool.free_blocks(self._held(list(reversed(tail))), front=True)
        return len(tail)

    def free(self, request_id: str) -> None:
        """Drop the request's references; its tail goes to the free queue first."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self.pool.free_blocks(self._held(list(reversed(blocks))))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]


class FullAttentionManager(SingleTypeKVCacheManager):
    pass


class SlidingWindowManager(SingleTypeKVCacheManager):
    def __init__(self, group: KVCacheGroupSpec, num_blocks: int, enable_caching: bool) -> None:
        super().__init__(group, num_blocks, enable_caching)
        self.window = group.sliding_window

    def first_needed(self, num_computed: int) -> int:
        """Index of the first block the query at position ``num_computed`` can see."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def _num_skipped_blocks(self, num_skipped_tokens: int) -> int:
        return self.first_needed(num_skipped_tokens) if num_skipped_tokens else 0

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_num_blocks: int
                               ) -> tuple[int, list[KVCacheBlock]]:
        """A hit of n blocks needs only the blocks the next query's window sees (the
        null block before them); the longest n <= max_num_blocks whose are all cached."""
        for n in range(max_num_blocks, 0, -1):
            first = self.first_needed(n * self.block_size)
            out = [self.pool.null_block] * first
            for h in block_hashes[first:n]:
                b = self.pool.get_cached_block(h)
                if b is None:
                    break
                out.append(b)
            else:
                return n, out
        return 0, []

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        table = self.req_to_blocks.get(request_id, [])
        for i in range(min(self.first_needed(num_computed_tokens), len(table))):
            if table[i] is not self.pool.null_block:
                self.pool.free_blocks([table[i]])
                table[i] = self.pool.null_block


class RunningStateManager(SingleTypeKVCacheManager):
    """Each running request holds one slot of the pool; its state is rebuilt after a
    prefix-cache hit from what the full group's blocks keep (block-edge snapshots), so
    it allows any hit."""

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_num_blocks: int
                               ) -> tuple[int, list[KVCacheBlock]]:
        if not all(getattr(s, "prefix_hits", True) for s in self.group.specs):
            return 0, []  # a state no hit can rebuild: every prompt from its start
        return max_num_blocks, []

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: list[KVCacheBlock], num_skipped_tokens: int = 0) -> int:
        return 0 if self.req_to_blocks.get(request_id) else 1

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_skipped_tokens: int = 0
                            ) -> list[KVCacheBlock]:
        table = self.req_to_blocks.setdefault(request_id, [])
        if table:
            return []
        table.extend(self.pool.get_new_blocks(1))
        return list(table)

    def cache_blocks(self, request_id: str, block_hashes: list[bytes], num_full_blocks: int) -> None:
        pass  # a slot is per request: nothing to share

    def free_tail(self, request_id: str, num_tokens: int) -> int:
        return 0  # the slot holds the state of every token


MANAGERS: dict[str, type[SingleTypeKVCacheManager]] = {
    FULL: FullAttentionManager, SLIDING_WINDOW: SlidingWindowManager, STATE: RunningStateManager}

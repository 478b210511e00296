"""Coordinates the single-type managers of every KV cache group (vLLM's
``kv_cache_coordinator.py``): a prefix hit is the longest one every group allows, and
an allocation either succeeds in every group or in none."""
from __future__ import annotations

from dataclasses import dataclass

from lane.core.block_pool import KVCacheBlock
from lane.core.single_type_kv_cache_manager import MANAGERS, SingleTypeKVCacheManager
from lane.kv_cache_interface import KVCacheConfig


@dataclass
class KVCacheBlocks:
    """Blocks of one request, one list per group (a hit, or what an allocation added)."""
    blocks: tuple[list[KVCacheBlock], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.blocks)

    @property
    def num_blocks(self) -> int:
        """Blocks of the main (first) group."""
        return len(self.blocks[0])


class KVCacheCoordinator:
    def __init__(self, kv_cache_config: KVCacheConfig, enable_caching: bool) -> None:
        self.managers: list[SingleTypeKVCacheManager] = [
            MANAGERS[g.kind](g, n, enable_caching)
            for g, n in zip(kv_cache_config.groups, kv_cache_config.num_blocks)]

    def empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in self.managers))

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_num_blocks: int
                               ) -> tuple[KVCacheBlocks, int]:
        """Shrink the hit until every group serves it whole (the intersection)."""
        n = max_num_blocks
        while True:
            hits = [m.find_longest_cache_hit(block_hashes, n) for m in self.managers]
            shortest = min((k for k, _ in hits), default=0)
            if shortest == n:
                return KVCacheBlocks(tuple(blocks for _, blocks in hits)), n
            n = shortest

    def allocate(self, request_id: str, num_tokens: int, hit: KVCacheBlocks, num_skipped_tokens: int = 0
                 ) -> KVCacheBlocks | None:
        """Slots for ``num_tokens`` tokens in every group (the hit taken first), or None
        when some group's pool cannot supply them (``num_skipped_tokens``: allocate_slots')."""
        for m, blocks in zip(self.managers, hit.blocks):
            if m.get_num_blocks_to_allocate(request_id, num_tokens, blocks, num_skipped_tokens) > m.pool.num_free_blocks:
                return None
        new = []
        for m, blocks in zip(self.managers, hit.blocks):
            m.save_new_computed_blocks(request_id, blocks)
            new.append(m.allocate_new_blocks(request_id, num_tokens, num_skipped_tokens))
        return KVCacheBlocks(tuple(new))

    def cache_blocks(self, request_id: str, block_hashes: list[bytes], num_computed_tokens: int,
                     window_from: int | None = None) -> None:
        """Register full blocks; release the window blocks the query at ``window_from`` (default:
        the next one) no longer sees."""
        for m in self.managers:
            m.cache_blocks(request_id, block_hashes, num_computed_tokens // m.block_size)
            m.remove_skipped_blocks(request_id, num_computed_tokens if window_from is None else window_from)

    def free_tail(self, request_id: str, num_tokens: int) -> int:
        return sum(m.free_tail(request_id, num_tokens) for m in self.managers)

    def free(self, request_id: str) -> None:
        for m in self.managers:
            m.free(request_id)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(m.block_ids(request_id) for m in self.managers)

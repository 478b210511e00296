"""KVCacheManager: the scheduler's view of the KV cache (seed steps 16, 18, 42, 52).
It hashes requests' full blocks for the prefix cache and asks the coordinator, which
keeps one single-type manager per KV cache group, for hits, slots and frees. Block ids
leave it as one list per group."""
from __future__ import annotations

from lane.core.block_pool import BlockPool, PrefixCacheStats
from lane.core.kv_cache_coordinator import KVCacheBlocks, KVCacheCoordinator
from lane.core.kv_cache_utils import hash_block_tokens
from lane.core.request import Request
from lane.kv_cache_interface import KVCacheConfig


class KVCacheManager:
    def __init__(self, kv_cache_config: KVCacheConfig, enable_caching: bool = True) -> None:
        self.kv_cache_config = kv_cache_config
        self.block_size = kv_cache_config.block_size
        self.enable_caching = enable_caching
        self.coordinator = KVCacheCoordinator(kv_cache_config, enable_caching)
        self.stats = PrefixCacheStats()

    @property
    def pool(self) -> BlockPool:
        """The main pool (the full-attention group's)."""
        return self.coordinator.managers[0].pool

    # -- hashing -----------------------------------------------------------
    def update_block_hashes(self, req: Request) -> None:
        """Extend req.block_hashes over every full block of its tokens."""
        bs = self.block_size
        hashes = req.block_hashes
        extra = (req.cache_salt,) if req.cache_salt else ()
        while len(hashes) < req.num_tokens // bs:
            i = len(hashes)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None,
                                            req.all_token_ids[i * bs:(i + 1) * bs], extra))

    # -- scheduling interface ---------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of full blocks every group allows (step 16). At least
        the last prompt token is always recomputed, so its logits exist."""
        if not self.enable_caching:
            return self.coordinator.empty(), 0
        self.update_block_hashes(req)
        hit, n = self.coordinator.find_longest_cache_hit(req.block_hashes, (req.num_tokens - 1) // self.block_size)
        return hit, n * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admitted request's lookup (vLLM counts queries and hits in tokens)."""
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0, num_skipped_tokens: int = 0) -> KVCacheBlocks | None:
        """Slots for ``num_new_tokens`` more tokens in every group (step 18 / 42), plus
        ``num_lookahead_tokens`` past them (an MTP drafter's own positions): the new blocks,
        or None if a pool cannot supply them (the caller then preempts). The first
        ``num_skipped_tokens`` tokens are computed already (a transfer's): a sliding window's
        blocks that the next query cannot see get the null block, not a slot."""
        hit = new_computed_blocks or self.coordinator.empty()
        total = req.num_computed_tokens + hit.num_blocks * self.block_size + num_new_tokens + num_lookahead_tokens
        return self.coordinator.allocate(req.request_id, total, hit, num_skipped_tokens)

    def cache_blocks(self, req: Request) -> None:
        """After a step: register newly full blocks in the prefix cache, release window
        blocks no future query can see."""
        if self.enable_caching:
            self.update_block_hashes(req)
        # a request handing its KV to a decode engine keeps the window its last prompt token saw:
        # the decode engine computes that token again from there
        window_from = req.num_computed_tokens - 1 if req.hands_over_kv else req.num_computed_tokens
        self.coordinator.cache_blocks(req.request_id, req.block_hashes, req.num_computed_tokens, window_from)

    def free_unused_slots(self, req: Request, num_tokens: int) -> int:
        """Step 48: give back the request's blocks past its first ``num_tokens`` tokens
        (rejected drafts' and lookahead slots). Returns the blocks freed."""
        return self.coordinator.free_tail(req.request_id, num_tokens)

    def free(self, req: Request) -> None:
        """Step 52: release a finished or preempted request's blocks (and state slot)."""
        self.coordinator.free(req.request_id)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.coordinator.get_block_ids(request_id)

    def num_blocks_held(self, request_id: str) -> int:
        """Main-pool blocks the request holds (for traces)."""
        return len(self.coordinator.managers[0].req_to_blocks.get(request_id, ()))

    @property
    def usage(self) -> float:
        return self.pool.usage()

"""The block pool of one KV cache group (seed steps 8, 16, 52): a fixed set of blocks,
an LRU free queue and the hash -> block map of the prefix cache.

A full block is identified by a chained hash (``kv_cache_utils.hash_block_tokens``), so
equal prefixes map to equal hashes. Freed blocks keep their hash and stay findable
until evicted: the free queue is LRU, cached-but-unused blocks count as free (as in vLLM).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """Fixed pool of blocks, an LRU free queue and the hash -> block map."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV pool needs at least 2 blocks, got {num_blocks}")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        # block 0 is the null block: never handed out, it pads block tables
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1
        # free blocks in eviction order (least recently freed first)
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks[1:])
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.num_evictions = 0  # cached blocks handed out again (their hash dropped from the map)

    @property
    def num_blocks(self) -> int:
        """Usable blocks (the null block excluded)."""
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on (possibly free, cached) blocks."""
        for b in blocks:
            if b.ref_cnt == 0:
                del self.free_queue[b.block_id]
            b.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, b = self.free_queue.popitem(last=False)
            if b.block_hash is not None:  # evict from the prefix cache
                if self.cached.get(b.block_hash) is b:
                    del self.cached[b.block_hash]
                    self.num_evictions += 1
                b.block_hash = None
            b.ref_cnt = 1
            out.append(b)
        return out

    def free_blocks(self, blocks: list[KVCacheBlock], front: bool = False) -> None:
        """Drop a reference; blocks reaching zero go to the tail of the free queue (callers
        pass a request's blocks in reverse, so its tail is evicted first), or with ``front``
        to its head: blocks that hold nothing worth caching, handed out before any that do."""
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if not self.enable_caching:
                    b.block_hash = None
                self.free_queue[b.block_id] = b
                if front:
                    self.free_queue.move_to_end(b.block_id, last=False)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        block.block_hash = block_hash
        # keep the first block with this hash; a duplicate simply stays unshared
        self.cached.setdefault(block_hash, block)

    def reset_prefix_cache(self) -> bool:
        if any(b.ref_cnt for b in self.blocks[1:]):
            return False
        self.cached.clear()
        for b in self.blocks:
            b.block_hash = None
        return True

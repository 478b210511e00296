"""KV block pool, block tables and the prefix cache (seed steps 8, 16, 18, 42, 52).

Blocks hold ``block_size`` tokens. A full block is identified by a chained hash
(parent hash + its token ids + extra keys), so equal prefixes map to equal
hashes. Freed blocks keep their hash and stay findable until evicted: the free
queue is LRU, cached-but-unused blocks count as free (as in vLLM).
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass

from lane.core.request import Request


def hash_block_tokens(parent: bytes | None, token_ids: list[int] | tuple[int, ...],
                      extra_keys: tuple = ()) -> bytes:
    h = hashlib.sha256(parent or b"\0")
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


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
                b.block_hash = None
            b.ref_cnt = 1
            out.append(b)
        return out

    def free_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Drop a reference; blocks reaching zero go to the tail of the free queue.
        Callers pass a request's blocks in reverse, so its tail is evicted first."""
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if not self.enable_caching:
                    b.block_hash = None
                self.free_queue[b.block_id] = b

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


@dataclass
class ComputedBlocks:
    """A prefix-cache hit: main-pool blocks, and for a window group the window blocks
    the next query's window needs (the null block before them)."""
    blocks: list[KVCacheBlock]
    window_blocks: list[KVCacheBlock] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


class BlockGroup:
    """One block-table group: a pool and each request's table of its blocks. The main
    group holds every block of a request; ``SlidingWindowBlocks`` releases old ones."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        # number of leading blocks of each request already in the prefix cache
        self.num_cached: dict[str, int] = {}

    def _held(self, blocks: list[KVCacheBlock]) -> list[KVCacheBlock]:
        return [b for b in blocks if b is not self.pool.null_block]

    def num_new_blocks(self, req: Request, total_blocks: int, hit: list[KVCacheBlock]) -> int:
        """Blocks to take from the free queue: new ones, and cached hits that sit in it."""
        have = len(self.req_blocks.get(req.request_id, ())) + len(hit)
        return max(total_blocks - have, 0) + sum(1 for b in self._held(hit) if b.ref_cnt == 0)

    def allocate(self, req: Request, total_blocks: int, hit: list[KVCacheBlock]) -> list[KVCacheBlock]:
        """Take the hit blocks, then new ones up to ``total_blocks``; returns the new ones."""
        blocks = self.req_blocks.setdefault(req.request_id, [])
        if hit:
            self.pool.touch(self._held(hit))
            blocks.extend(hit)
            self.num_cached[req.request_id] = len(blocks)
        new_blocks = self.pool.get_new_blocks(max(total_blocks - len(blocks), 0))
        blocks.extend(new_blocks)
        return new_blocks

    def cache_full_blocks(self, req: Request, num_full: int) -> None:
        """Register the request's newly full blocks (hashes already computed)."""
        blocks = self.req_blocks.get(req.request_id)
        if not blocks or not self.pool.enable_caching:
            return
        num_full = min(num_full, len(blocks))
        start = self.num_cached.get(req.request_id, 0)
        for i in range(start, num_full):
            if blocks[i] is not self.pool.null_block:
                self.pool.cache_block(blocks[i], req.block_hashes[i])
        self.num_cached[req.request_id] = max(start, num_full)

    def free(self, req: Request) -> None:
        """Drop the request's references; its tail goes to the free queue first."""
        blocks = self.req_blocks.pop(req.request_id, [])
        self.num_cached.pop(req.request_id, None)
        self.pool.free_blocks(self._held(list(reversed(blocks))))

    def block_ids(self, req: Request) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(req.request_id, ())]


class SlidingWindowBlocks(BlockGroup):
    """The sliding-window group (DeepSeek V4's raw K=V): its own pool and block tables.
    Once no future query of a request can see a block (it ends before the next query's
    window), the block is released: back to the free queue, or, hashed, kept findable
    by the prefix cache until evicted. Its table slot becomes the null block."""

    def __init__(self, num_blocks: int, block_size: int, window: int, enable_caching: bool) -> None:
        super().__init__(num_blocks, enable_caching)
        self.block_size = block_size
        self.window = window

    def first_needed(self, num_computed: int) -> int:
        """Index of the first block the query at position ``num_computed`` can see."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def cached_window(self, req: Request, num_blocks: int) -> list[KVCacheBlock] | None:
        """Window blocks for a hit of ``num_blocks`` full blocks, or None when one is gone."""
        first = self.first_needed(num_blocks * self.block_size)
        out = [self.pool.null_block] * first
        for h in req.block_hashes[first:num_blocks]:
            b = self.pool.get_cached_block(h)
            if b is None:
                return None
            out.append(b)
        return out

    def release_unseen(self, req: Request) -> None:
        """Release the blocks no future query of the request can see."""
        blocks = self.req_blocks.get(req.request_id, [])
        for i in range(min(self.first_needed(req.num_computed_tokens), len(blocks))):
            if blocks[i] is not self.pool.null_block:
                self.pool.free_blocks([blocks[i]])
                blocks[i] = self.pool.null_block


class KVCacheManager:
    """Per-request block tables on top of the BlockPool (plus, for models with a sliding
    window of raw tokens, the window group's own pool)."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_state_slots: int = 0, num_window_blocks: int = 0, window: int = 0) -> None:
        self.block_size = block_size
        self.window = (SlidingWindowBlocks(num_window_blocks, block_size, window, enable_caching)
                       if num_window_blocks else None)
        # running-state slots (compressed attention's pending windows), one per running
        # request, like a Mamba state; slot 0 is never handed out
        self.num_state_slots = num_state_slots
        self.free_state_slots = list(range(num_state_slots - 1, 0, -1))
        self.req_state_slot: dict[str, int] = {}
        self.enable_caching = enable_caching
        self.main = BlockGroup(num_blocks, enable_caching)
        self.pool = self.main.pool
        self.req_blocks = self.main.req_blocks
        self.stats = PrefixCacheStats()

    # -- hashing -----------------------------------------------------------
    def _extra_keys(self, req: Request) -> tuple:
        return (req.cache_salt,) if req.cache_salt else ()

    def update_block_hashes(self, req: Request) -> None:
        """Extend req.block_hashes over every full block of its tokens."""
        bs = self.block_size
        n_full = req.num_tokens // bs
        hashes = req.block_hashes
        extra = self._extra_keys(req)
        while len(hashes) < n_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, req.all_token_ids[i * bs:(i + 1) * bs], extra))

    # -- scheduling interface ---------------------------------------------
    def get_computed_blocks(self, req: Request) -> tuple[ComputedBlocks, int]:
        """Longest cached prefix of full blocks (step 16). At least the last
        prompt token is always recomputed, so its logits exist. With a window group,
        the hit also needs the window blocks the next query sees."""
        if not self.enable_caching:
            return ComputedBlocks([]), 0
        self.update_block_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hit: list[KVCacheBlock] = []
        for h in req.block_hashes[:max_blocks]:
            b = self.pool.get_cached_block(h)
            if b is None:
                break
            hit.append(b)
        if self.window is None:
            return ComputedBlocks(hit), len(hit) * self.block_size
        while hit:
            window = self.window.cached_window(req, len(hit))
            if window is not None:
                return ComputedBlocks(hit, window), len(hit) * self.block_size
            hit.pop()
        return ComputedBlocks([], []), 0

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admitted request's lookup (vLLM counts queries and hits in tokens)."""
        self.stats.queries += num_tokens
        self.stats.hits += num_hit_tokens

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed: ComputedBlocks | None = None) -> list[KVCacheBlock] | None:
        """Blocks for ``num_new_tokens`` more tokens (step 18 / 42), or None if
        the pool cannot supply them (the caller then preempts)."""
        hit = computed.blocks if computed else []
        window_hit = (computed.window_blocks if computed else None) or []
        needs_slot = self.num_state_slots and req.request_id not in self.req_state_slot
        if needs_slot and not self.free_state_slots:
            return None
        num_computed = req.num_computed_tokens + len(hit) * self.block_size
        total_blocks = -(-(num_computed + num_new_tokens) // self.block_size)
        for group, group_hit in ((self.main, hit), (self.window, window_hit)):
            if group is not None and group.num_new_blocks(req, total_blocks, group_hit) > group.pool.num_free_blocks:
                return None
        if needs_slot:
            self.req_state_slot[req.request_id] = self.free_state_slots.pop()
        if self.window is not None:
            self.window.allocate(req, total_blocks, window_hit)
        return self.main.allocate(req, total_blocks, hit)

    def cache_full_blocks(self, req: Request) -> None:
        """After a step: register newly completed blocks in the prefix cache (and
        release window blocks no future query can see)."""
        if self.enable_caching:
            self.update_block_hashes(req)
        num_full = req.num_computed_tokens // self.block_size
        self.main.cache_full_blocks(req, num_full)
        if self.window is not None:
            self.window.cache_full_blocks(req, num_full)
            self.window.release_unseen(req)

    def free(self, req: Request) -> None:
        """Step 52: release a finished or preempted request's blocks."""
        if (slot := self.req_state_slot.pop(req.request_id, None)) is not None:
            self.free_state_slots.append(slot)
        if self.window is not None:
            self.window.free(req)
        self.main.free(req)

    def state_slot(self, req: Request) -> int:
        return self.req_state_slot.get(req.request_id, 0)

    def get_block_ids(self, req: Request) -> list[int]:
        return self.main.block_ids(req)

    def get_window_block_ids(self, req: Request) -> list[int] | None:
        return self.window.block_ids(req) if self.window is not None else None

    @property
    def usage(self) -> float:
        return self.pool.usage()

"""Model-free tests of the KV cache layer: BlockPool, the single-type managers behind the
coordinator, KVCacheManager, and pool sizing (get_kv_cache_config). Configs are built
by hand; every expected block id and count below is derived by hand from the rules the
modules document (null block 0, LRU free queue, chained hashes, window release)."""
from __future__ import annotations

import re

import pytest
import torch

from lane.core.block_pool import BlockPool
from lane.core.kv_cache_manager import KVCacheManager
from lane.core.kv_cache_utils import get_kv_cache_config, hash_block_tokens, window_blocks_needed
from lane.core.request import Request
from lane.kv_cache_interface import (FULL, SLIDING_WINDOW, STATE, FullAttentionSpec, KVCacheConfig,
                                     KVCacheGroupSpec, RunningStateSpec, SlidingWindowSpec,
                                     group_kv_cache_specs)
from lane.sampling_params import SamplingParams

BS = 4  # tokens per block in every hand-built config


def full(num_blocks: int) -> tuple[KVCacheGroupSpec, int]:
    return KVCacheGroupSpec(FULL, BS, [], []), num_blocks


def window(num_blocks: int, sliding_window: int) -> tuple[KVCacheGroupSpec, int]:
    return KVCacheGroupSpec(SLIDING_WINDOW, BS, [], [], sliding_window=sliding_window), num_blocks


def state(num_slots: int) -> tuple[KVCacheGroupSpec, int]:
    return KVCacheGroupSpec(STATE, BS, [], []), num_slots


def manager(*groups: tuple[KVCacheGroupSpec, int], caching: bool = True) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig([g for g, _ in groups], [n for _, n in groups]), caching)


def req(rid: str, prompt: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=8), cache_salt=salt)


def prefill(kv: KVCacheManager, r: Request) -> int:
    """What the scheduler and runner do for a whole prompt in one step: look up the
    prefix cache, allocate the rest, compute it, register the full blocks. Returns the hit."""
    hit, n_hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - n_hit, hit) is not None
    r.num_computed_tokens = r.num_tokens
    kv.cache_blocks(r)
    return n_hit


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# -- BlockPool ---------------------------------------------------------------------------

def test_block_pool_null_block_and_first_allocations():
    pool = BlockPool(5, enable_caching=True)
    assert pool.num_blocks == 4 and pool.num_free_blocks == 4 and pool.usage() == 0.0
    assert pool.null_block.block_id == 0 and pool.null_block.ref_cnt == 1
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [1, 2, 3]
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.num_free_blocks == 1 and pool.usage() == 0.75
    with pytest.raises(RuntimeError, match="asked for 2 blocks, 1 free"):
        pool.get_new_blocks(2)
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockPool(1, enable_caching=True)


def test_block_pool_lru_least_recently_freed_first_and_touch():
    pool = BlockPool(5, enable_caching=True)
    b1, b2, b3, b4 = pool.get_new_blocks(4)
    pool.free_blocks([b3])
    pool.free_blocks([b1])
    pool.free_blocks([b2])
    pool.free_blocks([b4])
    assert list(pool.free_queue) == [3, 1, 2, 4]
    pool.touch([b1])  # a prefix hit on a free block takes it out of the queue
    assert b1.ref_cnt == 1 and list(pool.free_queue) == [3, 2, 4]
    assert [b.block_id for b in pool.get_new_blocks(2)] == [3, 2]
    pool.free_blocks([b1])  # back at the tail: now the most recently freed
    assert list(pool.free_queue) == [4, 1]


def test_block_pool_reuse_evicts_the_hash():
    pool = BlockPool(3, enable_caching=True)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_block(b1, b"h1")
    pool.free_blocks([b1])
    assert pool.get_cached_block(b"h1") is b1  # freed but findable until evicted
    assert pool.num_free_blocks == 1 and pool.usage() == 0.5  # cached-but-free counts as free
    (again,) = pool.get_new_blocks(1)
    assert again is b1 and b1.block_hash is None and pool.get_cached_block(b"h1") is None


# -- prefix cache through KVCacheManager --------------------------------------------------

def test_hit_is_full_blocks_only_and_the_last_prompt_token_is_recomputed():
    kv = manager(full(16))
    a = req("a", toks(1, 10))  # 10 tokens: blocks [1, 2, 3], two of them full
    assert prefill(kv, a) == 0
    assert kv.get_block_ids("a") == ([1, 2, 3],)
    cases = {  # prompt -> expected hit tokens, hand-derived: min(full blocks cached, (len-1)//4) * 4
        tuple(toks(1, 10)): 8,  # both full blocks, the 2 tail tokens recomputed
        tuple(toks(1, 9)): 8,  # (9-1)//4 = 2
        tuple(toks(1, 8)): 4,  # both blocks cached, but the last token must be recomputed
        tuple(toks(1, 7)): 4,
        tuple(toks(1, 5)): 4,
        tuple(toks(1, 4)): 0,  # (4-1)//4 = 0
        tuple([1, 2, 3, 50] + toks(5, 6)): 0,  # first block differs
    }
    for prompt, expected in cases.items():
        hit, n = kv.get_computed_blocks(req("q", prompt))
        assert n == expected, prompt
        assert hit.get_block_ids() == ([1, 2][:expected // BS],)


def test_block_hashes_are_chained():
    kv = manager(full(16))
    a = req("a", toks(1, 8) + [99])
    prefill(kv, a)
    assert a.block_hashes == [hash_block_tokens(None, [1, 2, 3, 4]),
                              hash_block_tokens(a.block_hashes[0], [5, 6, 7, 8])]
    # same second block, different first block: nothing is shared
    b = req("b", [50, 51, 52, 53, 5, 6, 7, 8, 99])
    assert kv.get_computed_blocks(b)[1] == 0
    assert b.block_hashes[1] != a.block_hashes[1]
    # equal first block, different suffix: only the first block hits
    c = req("c", [1, 2, 3, 4, 60, 61, 62, 63, 99])
    hit, n = kv.get_computed_blocks(c)
    assert n == 4 and hit.get_block_ids() == ([1],)


def test_cache_salt_separates_equal_prompts():
    kv = manager(full(32))
    prompt = toks(1, 9)
    prefill(kv, req("plain", prompt))  # blocks [1, 2, 3]
    s1 = req("s1", prompt, salt="tenant-1")
    assert prefill(kv, s1) == 0  # blocks [4, 5, 6]
    assert kv.get_computed_blocks(req("s1b", prompt, salt="tenant-1"))[0].get_block_ids() == ([4, 5],)
    assert kv.get_computed_blocks(req("s2", prompt, salt="tenant-2"))[1] == 0
    assert kv.get_computed_blocks(req("plain2", prompt))[0].get_block_ids() == ([1, 2],)


def test_shared_prefix_ref_counts_free_and_usage():
    kv = manager(full(9))  # 8 usable blocks
    a, b = req("a", toks(1, 9)), req("b", toks(1, 9))
    prefill(kv, a)
    assert prefill(kv, b) == 8
    assert kv.get_block_ids("a") == ([1, 2, 3],) and kv.get_block_ids("b") == ([1, 2, 4],)
    blocks = kv.pool.blocks
    assert [blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert kv.pool.num_free_blocks == 4 and kv.usage == 0.5
    kv.free(a)
    assert [blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 0, 1]
    assert kv.pool.num_free_blocks == 5
    kv.free(b)
    assert [blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [0, 0, 0, 0]
    assert kv.pool.num_free_blocks == 8 and kv.usage == 0.0
    # freed, the prefix is still findable
    assert kv.get_computed_blocks(req("c", toks(1, 9)))[0].get_block_ids() == ([1, 2],)


def test_free_evicts_a_requests_tail_before_its_head():
    kv = manager(full(9))  # 8 usable blocks
    a = req("a", toks(1, 12))
    prefill(kv, a)  # [1, 2, 3], all three full blocks cached
    kv.free(a)
    assert list(kv.pool.free_queue) == [4, 5, 6, 7, 8, 3, 2, 1]
    x = req("x", toks(100, 24))  # 6 blocks: the 5 never used, then a's tail
    prefill(kv, x)
    assert kv.get_block_ids("x") == ([4, 5, 6, 7, 8, 3],)
    # a's third block is gone from the cache, its first two remain
    hit, n = kv.get_computed_blocks(req("b", toks(1, 12) + [99]))
    assert n == 8 and hit.get_block_ids() == ([1, 2],)


def test_hit_blocks_waiting_in_the_free_queue_count_against_the_allocation():
    kv = manager(full(5))  # 4 usable blocks
    a = req("a", toks(1, 8))
    prefill(kv, a)
    kv.free(a)  # [1, 2] cached and free: 4 free blocks
    big = req("big", toks(1, 8) + toks(200, 9))  # 17 tokens: 5 blocks, 2 of them a hit
    hit, n = kv.get_computed_blocks(big)
    assert n == 8
    assert kv.allocate_slots(big, 9, hit) is None  # 3 new + 2 hits out of the queue > 4
    assert kv.pool.num_free_blocks == 4 and [b.ref_cnt for b in kv.pool.blocks[1:]] == [0, 0, 0, 0]
    assert kv.get_block_ids("big") == ([],)
    fits = req("fits", toks(1, 8) + toks(200, 7))  # 15 tokens: 4 blocks, 2 of them a hit
    hit, n = kv.get_computed_blocks(fits)
    new = kv.allocate_slots(fits, 7, hit)
    assert new.get_block_ids() == ([3, 4],)
    assert kv.get_block_ids("fits") == ([1, 2, 3, 4],) and kv.pool.num_free_blocks == 0


def test_caching_disabled_keeps_no_hashes():
    kv = manager(full(9), caching=False)
    a = req("a", toks(1, 9))
    prefill(kv, a)
    kv.free(a)
    hit, n = kv.get_computed_blocks(req("b", toks(1, 9)))
    assert n == 0 and hit.get_block_ids() == ([],)
    assert a.block_hashes == [] and kv.pool.cached == {}
    assert all(b.block_hash is None for b in kv.pool.blocks)


# -- sliding window ------------------------------------------------------------------------

def test_sliding_window_releases_blocks_before_the_window():
    kv = manager(full(16), window(8, 8))  # window pool: 7 usable blocks
    sw = kv.coordinator.managers[1]
    a = req("a", toks(1, 20))
    prefill(kv, a)
    # the next query (position 20) sees 13..20: blocks 0-2 (tokens 0..11) are released
    assert kv.get_block_ids("a") == ([1, 2, 3, 4, 5], [0, 0, 0, 4, 5])
    assert list(sw.pool.free_queue) == [6, 7, 1, 2, 3]
    assert kv.coordinator.managers[0].pool.num_free_blocks == 10
    # released but hashed: still findable until evicted
    assert sw.pool.get_cached_block(a.block_hashes[0]) is sw.pool.blocks[1]
    for t in (21, 22, 23, 24):
        a.append_output_token(t)
    new = kv.allocate_slots(a, 4)  # tokens 20..23: a sixth block in each group
    assert new.get_block_ids() == ([6], [6])
    a.num_computed_tokens = 24
    kv.cache_blocks(a)  # the next query (24) sees 17..24: block 3 goes too
    assert kv.get_block_ids("a") == ([1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 5, 6])
    assert list(sw.pool.free_queue) == [7, 1, 2, 3, 4]
    kv.free(a)
    assert sw.pool.num_free_blocks == 7 and kv.coordinator.managers[0].pool.num_free_blocks == 15


def test_sliding_window_boundary_the_window_includes_the_query():
    # window 8: the query at position p sees p-7..p
    kv = manager(full(16), window(16, 8))
    prefill(kv, req("ten", toks(1, 10)))  # next query 10 sees 3..10: block 0 (0..3) still needed
    assert kv.get_block_ids("ten")[1] == [1, 2, 3]
    prefill(kv, req("eleven", toks(50, 11)))  # next query 11 sees 4..11: block 0 released
    assert kv.get_block_ids("eleven")[1] == [0, 5, 6]
    # window 5: a hit of 2 blocks (next query 8 sees 4..8) needs block 1 only
    kv = manager(full(16), window(4, 5))  # 3 usable window blocks
    sw = kv.coordinator.managers[1]
    a = req("a", toks(1, 9))
    prefill(kv, a)  # window blocks [1, 2, 3]; next query 9 sees 5..9: block 0 released
    assert kv.get_block_ids("a")[1] == [0, 2, 3] and list(sw.pool.free_queue) == [1]
    assert kv.allocate_slots(req("x", toks(100, 3)), 3).get_block_ids() == ([4], [1])  # h0 evicted
    hit, n = kv.get_computed_blocks(req("b", toks(1, 9)))
    assert n == 8 and hit.get_block_ids() == ([1, 2], [0, 2])


def test_sliding_window_hit_needs_the_window_blocks_and_shrinks_when_one_is_evicted():
    kv = manager(full(32), window(8, 8))  # window 8: a hit of n blocks needs blocks (4n-7)//4 .. n-1
    sw = kv.coordinator.managers[1]
    prompt = toks(1, 17)
    a = req("a", prompt)
    prefill(kv, a)  # window blocks [1..5], hashes h0..h3 on 1..4; 1 and 2 released
    assert kv.get_block_ids("a")[1] == [0, 0, 3, 4, 5]
    hit, n = kv.get_computed_blocks(req("b", prompt))
    assert n == 16  # 4 blocks: the window needs only h2, h3
    assert hit.get_block_ids() == ([1, 2, 3, 4], [0, 0, 3, 4])
    kv.free(a)
    assert list(sw.pool.free_queue) == [6, 7, 1, 2, 5, 4, 3]
    c = req("c", toks(1, 9))  # hits h0, h1 (2 blocks), takes them out of the queue, then frees them last
    assert prefill(kv, c) == 8
    assert kv.get_block_ids("c")[1] == [1, 2, 6]
    kv.free(c)
    assert list(sw.pool.free_queue) == [7, 5, 4, 3, 6, 2, 1]
    x = req("x", toks(100, 12))  # 3 window blocks: 7, 5 and 4 (h3) are evicted
    prefill(kv, x)
    assert kv.get_block_ids("x")[1] == [0, 5, 4]  # its own block 0 released after the step
    hit, n = kv.get_computed_blocks(req("b2", prompt))
    # 4 blocks would need h3 (evicted); 3 blocks need h1, h2: both still cached
    assert n == 12
    assert hit.get_block_ids() == ([1, 2, 3], [0, 2, 3])


def test_all_or_nothing_when_the_window_pool_is_full():
    kv = manager(full(16), window(3, 16))  # window pool: 2 usable blocks
    a = req("a", toks(1, 8))
    assert kv.allocate_slots(a, 8).get_block_ids() == ([1, 2], [1, 2])
    b = req("b", toks(50, 4))
    assert kv.allocate_slots(b, 4) is None
    assert kv.coordinator.managers[0].pool.num_free_blocks == 13  # the full group took nothing either
    assert kv.get_block_ids("b") == ([], [])


# -- running state -------------------------------------------------------------------------

def test_running_state_one_slot_per_request_all_or_nothing():
    kv = manager(full(16), state(3))  # 2 usable slots
    a, b, c = req("a", toks(1, 4)), req("b", toks(20, 4)), req("c", toks(40, 4))
    assert kv.allocate_slots(a, 4).get_block_ids() == ([1], [1])
    a.append_output_token(5)
    a.num_computed_tokens = 4
    assert kv.allocate_slots(a, 1).get_block_ids() == ([2], [])  # the slot is kept, not renewed
    assert kv.allocate_slots(b, 4).get_block_ids() == ([3], [2])
    assert kv.allocate_slots(c, 4) is None  # no slot: refused, and no full block taken
    assert kv.coordinator.managers[0].pool.num_free_blocks == 12
    assert kv.get_block_ids("c") == ([], [])
    kv.free(a)
    assert kv.coordinator.managers[1].pool.num_free_blocks == 1
    assert kv.allocate_slots(c, 4).get_block_ids() == ([4], [1])


def test_running_state_group_allows_any_hit_length():
    kv = manager(full(16), state(3))
    prefill(kv, req("a", toks(1, 9)))
    hit, n = kv.get_computed_blocks(req("b", toks(1, 9)))
    assert n == 8 and hit.get_block_ids() == ([1, 2], [])


# -- specs, groups and sizing ---------------------------------------------------------------

def test_group_kv_cache_specs_orders_and_merges_groups():
    f16, f32 = torch.float16, torch.float32
    specs = {
        "s.state": RunningStateSpec(4, f32, (2, 3, 8)),  # 48 floats: 192 B a slot
        "w16.kv": SlidingWindowSpec(4, f16, 8, 16),  # 4*8 halves: 64 B a block
        "a.k": FullAttentionSpec(4, f16, 2, 8),  # 2*4*8 halves: 128 B a block
        "w8.kv": SlidingWindowSpec(4, f16, 8, 8),
        "a.v": FullAttentionSpec(4, f16, 2, 8),
    }
    groups = group_kv_cache_specs(specs)
    assert [(g.kind, g.sliding_window, g.layer_names) for g in groups] == [
        (FULL, 0, ["a.k", "a.v"]), (SLIDING_WINDOW, 8, ["w8.kv"]),
        (SLIDING_WINDOW, 16, ["w16.kv"]), (STATE, 0, ["s.state"])]
    assert [g.page_size_bytes for g in groups] == [256, 64, 64, 192]
    cfg = KVCacheConfig(groups, [10, 5, 6, 3])
    assert cfg.block_size == 4
    assert cfg.group_bytes(0) == 2560
    assert cfg.total_bytes == 2560 + 320 + 384 + 576
    assert cfg.first_group(STATE) == 3 and cfg.first_group(SLIDING_WINDOW) == 1


def test_window_blocks_needed():
    # window 64, blocks of 16: ceil(63/16)+1 = 5 a request; a 64-token chunk: 4+1 = 5
    assert window_blocks_needed(64, 16, 4, 64) == (4 * 5 + 5 + 4 + 1, 5 + 5 + 1)
    # window 8, blocks of 4: 2+1 = 3 a request; a 10-token chunk: 3+1 = 4
    assert window_blocks_needed(8, 4, 2, 10) == (2 * 3 + 4 + 2 + 1, 3 + 4 + 1)


def _sized_groups(with_window: bool = False, with_state: bool = False) -> list[KVCacheGroupSpec]:
    """Blocks of 16 tokens: the full group (K + V, 64 B each) and the window group 128 B a
    block; a running-state slot 192 B."""
    specs = {"l.k": FullAttentionSpec(16, torch.float16, 1, 2), "l.v": FullAttentionSpec(16, torch.float16, 1, 2)}
    if with_window:
        specs["w.kv"] = SlidingWindowSpec(16, torch.float16, 4, 64)  # 16*4*2 = 128 B
    if with_state:
        specs["s.state"] = RunningStateSpec(16, torch.float32, (2, 3, 8))  # 192 B a slot
    return group_kv_cache_specs(specs)


def test_kv_cache_config_full_only_and_the_error_naming_the_flag():
    groups = _sized_groups()
    assert groups[0].page_size_bytes == 128
    # max_model_len 1584 = 99 blocks, + the null block: 100 blocks = 12800 B
    assert get_kv_cache_config(groups, 12800, 4, 64, 1584).num_blocks == [100]
    assert get_kv_cache_config(groups, 12927, 4, 64, 1584).num_blocks == [100]
    with pytest.raises(ValueError) as e:
        get_kv_cache_config(groups, 12799, 4, 64, 1584)
    msg = str(e.value)
    assert "holds 99 blocks of 16 tokens" in msg and "needs 100" in msg
    assert "--kv-cache-memory-bytes to at least 12800" in msg and "--max-model-len" in msg
    assert get_kv_cache_config(groups, 300, 4, 64, None).num_blocks == [2]  # no check without a length


def test_kv_cache_config_window_pool_between_one_requests_need_and_half_the_budget():
    groups = _sized_groups(with_window=True, with_state=True)
    assert [g.kind for g in groups] == [FULL, SLIDING_WINDOW, STATE]
    # window 64, blocks of 16, 4 seqs, 64-token steps: at most 30 window blocks, at least 11
    # a large budget: the most (30 blocks = 3840 B); the full pool gets the rest
    assert get_kv_cache_config(groups, 128 * 200, 4, 64, None).num_blocks == [170, 30, 5]
    # 40 blocks' worth: half is 20 blocks, between 11 and 30
    assert get_kv_cache_config(groups, 128 * 40, 4, 64, None).num_blocks == [20, 20, 5]
    # 16 blocks' worth: half is 8 < 11, so 11; the full pool 5
    assert get_kv_cache_config(groups, 128 * 16, 4, 64, None).num_blocks == [5, 11, 5]
    # state slots are max_num_seqs + 1 and come besides the budget
    assert get_kv_cache_config(groups, 128 * 40, 7, 64, None).num_blocks[2] == 8


def test_kv_cache_config_needs_exactly_one_full_group():
    sw_only = [g for g in _sized_groups(with_window=True) if g.kind == SLIDING_WINDOW]
    with pytest.raises(ValueError, match="exactly one full-attention"):
        get_kv_cache_config(sw_only, 1 << 20, 4, 64, None)
    two = group_kv_cache_specs({"a": FullAttentionSpec(16, torch.float16, 1, 2),
                                "b": FullAttentionSpec(32, torch.float16, 1, 2)})
    with pytest.raises(ValueError, match="exactly one full-attention"):
        get_kv_cache_config(two, 1 << 20, 4, 64, None)


def test_kv_cache_config_window_budget_boundary():
    groups = _sized_groups(with_window=True)
    # max_model_len 400: 25 blocks + null = 26 full blocks (3328 B). At budget B the window
    # takes min(30, B // 256) blocks (>= 11), so the least budget is 51 blocks' worth:
    # 6528 B -> window 25 blocks, 3328 B left
    assert get_kv_cache_config(groups, 6528, 4, 64, 400).num_blocks == [26, 25]
    with pytest.raises(ValueError, match="holds 25 blocks"):
        get_kv_cache_config(groups, 6527, 4, 64, 400)


def test_kv_cache_config_suggested_budget_is_enough_with_a_window_pool():
    """The error's "raise --kv-cache-memory-bytes to at least N" must be a budget that works."""
    groups = _sized_groups(with_window=True)
    with pytest.raises(ValueError) as e:
        get_kv_cache_config(groups, 128 * 30, 4, 64, 400)
    suggested = int(re.search(r"--kv-cache-memory-bytes to at least (\d+)", str(e.value)).group(1))
    assert get_kv_cache_config(groups, suggested, 4, 64, 400).num_blocks[0] == 26
    assert suggested == 6528  # and it is the least (test_kv_cache_config_window_budget_boundary)

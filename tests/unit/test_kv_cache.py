"""Block pool and per-request allocation: exact block ids, ref counts, free order, prefix sharing."""

from __future__ import annotations

import pytest
from fakes import make_request

from tokenmill.kv_cache import BlockPool, KVCacheManager, PrefixHit, hash_block


def test_pool_hands_out_blocks_in_order_and_reuses_the_last_freed_first():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    pool.free([1, 0])
    assert pool.allocate(2) == [0, 1]   # last freed first: warm memory, untouched blocks stay so
    assert pool.allocate(1) == [3]
    assert pool.ref_counts == [1, 1, 1, 1]
    pool.check_invariants()


def test_pool_rejects_overallocation_and_double_free():
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.allocate(3)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(blocks)


def test_cached_blocks_are_evicted_lru_and_only_when_free_blocks_run_out():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, b"ha")
    pool.cache(b, b"hb")
    pool.free([b, a, c])            # b freed before a: b is older in the LRU order
    assert pool.num_evictable_blocks == 2 and pool.num_free_blocks == 3
    assert pool.allocate(1) == [c]  # the uncached block goes first
    assert pool.allocate(1) == [b]  # then the least recently freed cached block
    assert pool.lookup(b"hb") is None and pool.lookup(b"ha") == a
    assert pool.num_evictions == 1
    pool.share([a])                 # a prefix hit revives a from the evictable pool
    assert pool.ref_counts[a] == 1 and pool.num_evictable_blocks == 0
    pool.check_invariants()


def test_allocate_grows_block_table_on_demand():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    r = make_request("a", prompt_len=6)
    assert kv.allocate(r, 6)
    assert r.block_ids == [0, 1]
    r.num_computed_tokens = 6
    assert kv.allocate(r, 2) and r.block_ids == [0, 1]   # slots 6, 7 fit in block 1
    r.num_computed_tokens = 8
    assert kv.allocate(r, 1) and r.block_ids == [0, 1, 2]
    assert not kv.allocate(r, 100) and r.block_ids == [0, 1, 2]  # too big: nothing changes
    kv.free(r)
    assert r.block_ids == [] and kv.num_free_blocks == 8
    assert kv.allocate(make_request("b", prompt_len=1), 1)
    assert kv.pool.num_used_blocks == 1


def test_identical_prefixes_share_blocks_with_ref_counts():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("a", prompt_len=10)
    kv.allocate(first, 10, kv.find_prefix(first))
    first.num_computed_tokens = 10       # blocks 0 and 1 were cached when the step was scheduled
    second = make_request("b", prompt_len=10)
    hit = kv.find_prefix(second)
    assert hit.block_ids == first.block_ids[:2] and hit.num_tokens == 8
    assert kv.allocate(second, 2, hit)
    assert second.block_ids[:2] == first.block_ids[:2] and second.block_ids[2] != first.block_ids[2]
    assert second.num_computed_tokens == 0   # the scheduler's counter: it moves it past the hit
    assert [kv.pool.ref_counts[b] for b in first.block_ids] == [2, 2, 1]
    kv.free(first)
    assert [kv.pool.ref_counts[b] for b in second.block_ids] == [1, 1, 1]
    kv.pool.check_invariants()


def test_each_full_block_is_offered_to_the_cache_once_and_again_after_a_preemption(monkeypatch):
    """Decode steps fill one block at a time: the blocks already offered are not offered again
    (that cost a millisecond a step at batch 256), but blocks given anew after a preemption are."""
    kv = KVCacheManager(num_blocks=16, block_size=4, num_host_blocks=8)
    offered = []
    cache = kv.pool.cache
    monkeypatch.setattr(kv.pool, "cache", lambda block, h: (offered.append(block), cache(block, h)))
    r = make_request("a", prompt_len=6)
    assert kv.allocate(r, 6, kv.find_prefix(r)) and offered == [r.block_ids[0]]
    r.num_computed_tokens = 6
    for _ in range(7):                   # decode steps: tokens 7..13, blocks 1 and 2 fill
        r.token_ids.append(5)
        assert kv.allocate(r, 1)
        r.num_computed_tokens += 1
    assert offered == r.block_ids[:3] and kv.pool.cached == {h: b for h, b in zip(r.block_hashes, r.block_ids)}
    kv.free(r)                           # preempted, then recomputed into other blocks
    kv.pool.uncache(list(range(16)))
    offered.clear()
    assert kv.allocate(r, r.num_tokens) and offered == r.block_ids[:3]
    r.num_computed_tokens = r.num_tokens
    kv.swap_out(r)                       # preempted by swapping, then back into other blocks
    kv.pool.uncache(list(range(16)))
    offered.clear()
    kv.swap_in(r, 1)
    assert offered == r.block_ids[:3]


def test_a_block_whose_twin_is_cached_takes_its_place_once_the_twin_is_evicted():
    """A request that computed its prefix itself (no lookup: it wants prompt logprobs) holds
    twins of cached blocks: they replace the originals once those are evicted, and are forgotten
    when freed first."""
    kv = KVCacheManager(num_blocks=6, block_size=4)
    first, twin = make_request("a", prompt_len=9), make_request("b", prompt_len=9)
    for r in (first, twin):
        assert kv.allocate(r, 9)         # twin: no prefix lookup
        r.num_computed_tokens = 9
    assert kv.pool.cached == {h: b for h, b in zip(first.block_hashes, first.block_ids)}
    assert sorted(kv.pool.twin_hash) == sorted(twin.block_ids[:2])
    kv.free(first)
    taken = kv.pool.allocate(kv.pool.num_free_blocks)  # every free block, evicting the first's cached ones
    assert kv.pool.cached == {h: b for h, b in zip(twin.block_hashes, twin.block_ids)} and not kv.pool.twins
    kv.pool.check_invariants()
    kv.pool.free(taken)
    again = make_request("c", prompt_len=9)
    assert kv.allocate(again, 9) and kv.pool.twin_hash.keys() == set(again.block_ids[:2])
    kv.free(again)                       # a twin freed before its original: forgotten
    assert not kv.pool.twins and kv.pool.num_free_blocks == 3 and kv.pool.num_evictable_blocks == 0
    kv.pool.check_invariants()


def test_a_fully_cached_prompt_still_computes_its_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("a", prompt_len=8)
    kv.allocate(first, 8, kv.find_prefix(first))
    first.num_computed_tokens = 8
    again = make_request("b", prompt_len=8)
    hit = kv.find_prefix(again)
    assert hit.num_tokens == 4           # at most 7 tokens reusable: one full block


def test_block_hash_chains_through_the_parent():
    h1 = hash_block(None, [1, 2, 3, 4])
    assert hash_block(h1, [5, 6, 7, 8]) != hash_block(hash_block(None, [9, 9, 9, 9]), [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4]) == h1


def test_blocks_outside_the_window_are_given_back_and_their_entries_point_at_the_null_block():
    """Window 6, block_size 4: the next query, at position num_computed_tokens = c, sees c - 5 .. c,
    so block 0 (0..3) is outside from c = 9 on, block 1 from c = 13 on."""
    kv = KVCacheManager(num_blocks=8, block_size=4, window=6)
    r = make_request("a", prompt_len=16)
    assert kv.allocate(r, 8, kv.find_prefix(r))
    r.num_computed_tokens = 8
    assert kv.release_outside_window(r) == 0 and r.block_ids == [0, 1]  # query 8 sees 3..8
    assert kv.allocate(r, 1)
    r.num_computed_tokens = 9
    assert kv.release_outside_window(r) == 1 and r.block_ids == [8, 1, 2] and r.num_released_blocks == 1
    assert kv.pool.ref_counts[0] == 0 and kv.pool.num_evictable_blocks == 1  # still cached: a prefix
    assert kv.release_outside_window(r) == 0
    assert kv.allocate(r, 4) and r.block_ids == [8, 1, 2, 3]
    r.num_computed_tokens = 13
    assert kv.release_outside_window(r) == 1 and r.block_ids == [8, 8, 2, 3]
    assert kv.num_free_blocks == 8 - 2 and not kv.can_swap_out(r)
    kv.free(r)                                        # the released entries are not freed twice
    assert r.block_ids == [] and r.num_released_blocks == 0 and kv.num_free_blocks == 8
    kv.pool.check_invariants()


def test_a_windowed_prefix_hit_needs_only_the_blocks_its_window_sees():
    """Window 4, block_size 4: a hit of 12 tokens leaves the next query (12) seeing 9..12, so only
    block 2 of the prefix must be cached; the hit skips blocks 0 and 1 (null entries), survives
    their eviction, and stops only once block 2 is evicted too."""
    kv = KVCacheManager(num_blocks=6, block_size=4, window=4)
    first = make_request("a", prompt_len=13)
    assert kv.allocate(first, 13, kv.find_prefix(first))
    first.num_computed_tokens = 13                    # next query 13 sees 10..13
    assert kv.release_outside_window(first) == 2 and first.block_ids == [6, 6, 2, 3]
    same = make_request("b", prompt_len=13)
    hit = kv.find_prefix(same)
    assert hit == PrefixHit([2], 12, 2)
    assert kv.allocate(same, 1, hit) and same.block_ids == [6, 6, 2, 4] and same.num_released_blocks == 2
    assert kv.pool.ref_counts[2] == 2
    kv.free(same)
    kv.free(first)
    assert sorted(kv.pool.allocate(5)) == [0, 1, 3, 4, 5]  # the free ones, then 0 and 1 evicted
    assert kv.find_prefix(same) == PrefixHit([2], 12, 2)
    assert kv.pool.allocate(1) == [2]
    assert kv.find_prefix(same) == PrefixHit([], 0)
    kv.pool.check_invariants()

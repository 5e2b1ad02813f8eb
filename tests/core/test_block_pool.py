from __future__ import annotations

import pytest

from chunkserve.core.kv.block_pool import BlockPool
from chunkserve.core.kv.kv_cache_manager import KVCacheManager


def test_allocate_is_all_or_nothing():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)


def test_double_free_is_caught():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(blocks)


def test_block_table_grows_by_whole_blocks_and_frees_everything():
    manager = KVCacheManager(num_blocks=10, block_size=4)
    assert manager.allocate_slots("a", 5) == [0, 1]
    assert manager.allocate_slots("a", 8) == []
    assert manager.allocate_slots("a", 9) == [2]
    assert manager.block_table("a") == [0, 1, 2]
    assert manager.allocate_slots("b", 100) is None and manager.block_table("b") == []
    manager.free("a")
    assert manager.num_free_blocks == 10


def test_free_cached_blocks_are_evicted_least_recently_freed_first():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, b"A")
    pool.cache(b, b"B")
    pool.free([b])
    pool.free([a])
    assert pool.num_free_blocks == 2 and pool.lookup(b"A") == a and pool.lookup(b"B") == b
    assert pool.allocate(1) == [b]
    assert pool.lookup(b"B") is None and pool.lookup(b"A") == a and pool.num_evictions == 1


def test_touching_a_free_cached_block_takes_it_out_of_the_free_queue():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, b"A")
    pool.free([a, b])
    pool.touch([a])
    assert pool.ref_count(a) == 1 and pool.num_free_blocks == 1
    assert pool.allocate(2) is None and pool.allocate(1) == [b]
    pool.touch([a])
    pool.free([a])
    assert pool.ref_count(a) == 1 and pool.lookup(b"A") == a


def test_a_hash_another_block_holds_is_not_registered_twice():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache(a, b"A")
    pool.cache(b, b"A")
    assert pool.lookup(b"A") == a and pool.num_cached_blocks == 1


def test_reset_cache_needs_every_block_free():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache(a, b"A")
    assert not pool.reset_cache()
    pool.free([a])
    assert pool.reset_cache() and pool.lookup(b"A") is None and pool.num_free_blocks == 2


def test_blocks_holding_no_cached_prefix_are_reused_before_cached_ones():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.cache(a, b"A")
    pool.free([a, b, c])
    assert pool.allocate(2) == [c, b] and pool.lookup(b"A") == a

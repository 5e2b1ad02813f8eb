from __future__ import annotations

import pytest

from chunkserve.core.block_pool import BlockPool
from chunkserve.core.kv_cache_manager import KVCacheManager


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

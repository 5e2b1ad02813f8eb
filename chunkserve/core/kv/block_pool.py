"""The pool of KV cache blocks (pages): reference counts, the free queue, and the prefix
cache's index from block hash to block.

A block is in use while some request holds it (reference count > 0). A free block waits in
an LRU queue; if it holds a cached prefix (a full block whose hash is known) it stays findable
by that hash until an allocation needs room and evicts it. So "free" counts cached blocks too:
they cost nothing to take back.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable

from chunkserve.core.kv.events import KVEventLog


class BlockPool:
    """Blocks `0..num_blocks-1`. Allocation takes free blocks holding no cached prefix first,
    then the least recently freed cached ones."""

    def __init__(self, num_blocks: int, events: KVEventLog | None = None) -> None:
        """`events`: told each eviction and each reset (KV events for routers); what becomes
        cached is told by the KV cache manager, which knows the tokens."""
        assert num_blocks > 0, "the KV pool needs at least one block"
        self.num_blocks = num_blocks
        self.events = events
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest first
        self._ref_counts = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # block hash -> the block holding that prefix
        self.num_evictions = 0
        # told (block id, block hash) when a cached block is evicted (its KV is about to be
        # overwritten) and when a block becomes cached (its KV is computed): a KV tier's hooks
        self.on_evict: Callable[[int, bytes], None] | None = None
        self.on_cache: Callable[[int, bytes], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by hash, held or free."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0.0 to 1.0 (cached free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, count: int) -> list[int] | None:
        """Take `count` blocks, evicting the least recently freed cached ones as needed;
        None (taking nothing) if fewer are free."""
        if count > len(self._free):
            return None
        blocks = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self._ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def touch(self, block_ids: list[int]) -> None:
        """Take one more reference on cached blocks (a prefix-cache hit); a free one leaves
        the free queue, so no allocation can evict it."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference per block. A block nobody holds joins the free queue: at the
        tail (evicted last) if it keeps a cached prefix, at the head (reused first) if it
        holds nothing worth keeping (a partial last block, a duplicate)."""
        for block_id in block_ids:
            assert self._ref_counts[block_id] > 0, f"block {block_id} freed twice"
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free[block_id] = None
                if self._hash_of[block_id] is None:
                    self._free.move_to_end(block_id, last=False)

    def cache(self, block_id: int, block_hash: bytes) -> bool:
        """Make a full, computed block findable by its hash; whether it became cached. A block
        already cached, or a hash another block already holds (two requests computed the same
        prefix at once), is left alone: the duplicate is an ordinary block and is reused when freed."""
        if self._hash_of[block_id] is not None or block_hash in self._cached:
            return False
        self._hash_of[block_id] = block_hash
        self._cached[block_hash] = block_id
        if self.on_cache is not None:
            self.on_cache(block_id, block_hash)
        return True

    def check(self, holders: Counter[int]) -> list[str]:
        """What is inconsistent, given how many holders each block has: its reference count
        must equal them, it must be free exactly when it has none, the cache map must agree."""
        problems = []
        for block_id, count in enumerate(self._ref_counts):
            if count != holders.get(block_id, 0):
                problems.append(f"block {block_id} has reference count {count} but {holders.get(block_id, 0)} holders")
            is_free = block_id in self._free
            if (count == 0) != is_free:
                problems.append(f"block {block_id} (reference count {count}) is {'' if is_free else 'not '}in the free list")
        for block_hash, block_id in self._cached.items():
            if self._hash_of[block_id] != block_hash:
                problems.append(f"block {block_id} is cached under a hash it does not hold")
        return problems

    def lookup(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def is_cached(self, block_id: int) -> bool:
        return self._hash_of[block_id] is not None

    def cached_blocks(self) -> list[tuple[bytes, int]]:
        """(block hash, block id) of every cached block, held or free, oldest cached first."""
        return list(self._cached.items())

    def reset_cache(self) -> bool:
        """Forget every cached prefix; refused (False) unless no request holds any block."""
        if len(self._free) != self.num_blocks:
            return False
        for block_id in self._cached.values():
            self._hash_of[block_id] = None
        self._cached.clear()
        if self.events is not None:
            self.events.cleared()
        return True

    def _evict(self, block_id: int) -> None:
        block_hash = self._hash_of[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self._hash_of[block_id] = None
            self.num_evictions += 1
            if self.events is not None:
                self.events.removed(block_hash)
            if self.on_evict is not None:
                self.on_evict(block_id, block_hash)

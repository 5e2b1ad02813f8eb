"""The pool of KV cache blocks (pages): which are free, which are taken."""

from __future__ import annotations

from collections import deque


class BlockPool:
    """A free list over block ids `0..num_blocks-1`.

    Ids are handed out in the order they were freed, so recently used pages are reused
    last (room for LRU eviction of cached prefixes later).
    """

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks > 0, "the KV pool needs at least one block"
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 to 1.0."""
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, count: int) -> list[int] | None:
        """Take `count` blocks, or None (taking nothing) if fewer are free."""
        if count > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(count)]
        for block_id in blocks:
            self._is_free[block_id] = False
        return blocks

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            assert not self._is_free[block_id], f"block {block_id} freed twice"
            self._is_free[block_id] = True
            self._free.append(block_id)

"""Per-request block tables on top of the block pool.

Token position p of a request lives in KV slot
`block_table[p // block_size] * block_size + p % block_size`:

    block_size = 4, block_table = [7, 2]
    positions   0  1  2  3 | 4  5  6
    slots      28 29 30 31 | 8  9 10
"""

from __future__ import annotations

from chunkserve.core.block_pool import BlockPool


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns every request's block table. The scheduler asks it for room before it
    schedules tokens; the model runner only ever sees copies of the tables."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self._block_tables.get(request_id, [])

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> list[int] | None:
        """Make room for the request's first `num_total_tokens` tokens.

        Returns the newly added block ids (possibly none), or None when the pool is short;
        then nothing is allocated and the caller decides whom to preempt.
        """
        table = self._block_tables.setdefault(request_id, [])
        needed = self.num_blocks_for(num_total_tokens) - len(table)
        if needed <= 0:
            return []
        new_blocks = self.pool.allocate(needed)
        if new_blocks is None:
            if not table:
                del self._block_tables[request_id]
            return None
        table.extend(new_blocks)
        return new_blocks

    def free(self, request_id: str) -> None:
        """Return all of a request's blocks to the pool; a no-op if it holds none."""
        table = self._block_tables.pop(request_id, None)
        if table:
            self.pool.free(table)

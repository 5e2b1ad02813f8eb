"""The worker's persistent batch: every request it knows, kept from its first step to its end.

Each request has a row in one block-table array, updated in place from the scheduler's
diffs (the blocks added since the last step, or a new table after a preemption), and the
sampler's state (token history, seeded generator). A preempted request keeps both: only its
KV is dropped, and its row is refilled when it runs again. Rows of finished requests are
reused; the arrays grow when rows or columns run out. Nothing is rebuilt from the scheduler's
message but the step's own flat batch (input_batch.py)."""

from __future__ import annotations

import numpy as np

from chunkserve.core.messages import ScheduledRequest
from chunkserve.worker.sampler import SamplingState


class PersistentBatch:
    def __init__(self, num_rows: int = 16, num_columns: int = 16) -> None:
        self.block_table = np.zeros((num_rows, num_columns), dtype=np.int64)
        self.num_blocks = np.zeros(num_rows, dtype=np.int64)
        self.sampling: dict[str, SamplingState] = {}
        self._rows: dict[str, int] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, request_id: str, sampling: SamplingState) -> None:
        if not self._free_rows:
            self._grow(rows=2 * len(self.num_blocks))
        row = self._free_rows.pop()
        self._rows[request_id] = row
        self.num_blocks[row] = 0
        self.sampling[request_id] = sampling

    def remove(self, request_id: str) -> None:
        row = self._rows.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)
            del self.sampling[request_id]

    def update_blocks(self, scheduled: ScheduledRequest) -> None:
        """Apply the step's diff of the request's block table."""
        row = self._rows[scheduled.request_id]
        start = 0 if scheduled.resets_block_table else int(self.num_blocks[row])
        end = start + len(scheduled.new_block_ids)
        if end > self.block_table.shape[1]:
            self._grow(columns=max(end, 2 * self.block_table.shape[1]))
        self.block_table[row, start:end] = scheduled.new_block_ids
        self.num_blocks[row] = end

    def blocks(self, request_id: str) -> np.ndarray:
        """The request's block table: a view of its row."""
        row = self._rows[request_id]
        return self.block_table[row, : self.num_blocks[row]]

    def _grow(self, rows: int | None = None, columns: int | None = None) -> None:
        old_rows, old_columns = self.block_table.shape
        rows, columns = rows or old_rows, columns or old_columns
        table = np.zeros((rows, columns), dtype=np.int64)
        table[:old_rows, :old_columns] = self.block_table
        self.block_table = table
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros(rows - old_rows, dtype=np.int64)])
        self._free_rows = list(range(rows - 1, old_rows - 1, -1)) + self._free_rows

"""The worker's persistent batch: block tables kept across steps from the scheduler's diffs."""

from __future__ import annotations

import numpy as np

from chunkserve.core.messages import ScheduledRequest
from chunkserve.sampling_params import SamplingParams
from chunkserve.worker.persistent_batch import PersistentBatch
from chunkserve.worker.sampler import SamplingState


def state() -> SamplingState:
    return SamplingState(SamplingParams(), [1, 2, 3], 3, None, None)


def diff(request_id: str, new_block_ids: list[int], resets: bool = False) -> ScheduledRequest:
    return ScheduledRequest(request_id, 0, 1, new_block_ids, resets, True, False)


def test_diffs_extend_a_table_and_a_resumed_request_starts_anew():
    batch = PersistentBatch(num_rows=2, num_columns=2)
    batch.add("a", state())
    batch.update_blocks(diff("a", [7, 3], resets=True))
    batch.update_blocks(diff("a", []))
    batch.update_blocks(diff("a", [9, 1, 4]))  # past the columns: they grow
    assert batch.blocks("a").tolist() == [7, 3, 9, 1, 4]
    batch.update_blocks(diff("a", [5], resets=True))  # preempted and resumed
    assert batch.blocks("a").tolist() == [5]


def test_rows_are_reused_and_grow_without_moving_anyone_elses_table():
    batch = PersistentBatch(num_rows=2, num_columns=4)
    for index, request_id in enumerate("abc"):  # the third outgrows the rows
        batch.add(request_id, state())
        batch.update_blocks(diff(request_id, [10 * index, 10 * index + 1], resets=True))
    batch.remove("b")
    batch.add("d", state())  # b's row, emptied
    batch.update_blocks(diff("d", [99], resets=True))
    assert {r: batch.blocks(r).tolist() for r in "acd"} == {"a": [0, 1], "c": [20, 21], "d": [99]}
    assert "b" not in batch and len(batch) == 3 and isinstance(batch.blocks("a"), np.ndarray)

"""The chunk-length rules on their own: Sarathi-Serve's decreasing schedule and alignment."""

from __future__ import annotations

import pytest

from chunkserve.config.scheduler import ChunkSchedule
from chunkserve.core.sched.chunking import align_chunk
from chunkserve.errors import InvalidRequestError


def test_schedule_steps_down_linearly_over_equal_stages():
    schedule = ChunkSchedule.parse("512:128:4:4096")
    assert schedule.tokens_per_stage == 1024
    sizes = [schedule.step_tokens(n) for n in (0, 1023, 1024, 2048, 3072, 4095, 4096, 100_000)]
    assert sizes == [512, 512, 384, 256, 128, 128, 128, 128]
    assert ChunkSchedule.parse("256:256:1:1").step_tokens(10**6) == 256


@pytest.mark.parametrize("spec, message", [
    ("512:128:4", "four integers"),
    ("512:x:4:4096", "four integers"),
    ("128:512:4:4096", "low <= high"),
    ("512:128:0:4096", "stages >= 1"),
    ("512:128:8:4", "max_tokens >= stages"),
])
def test_bad_schedules_are_clear_errors(spec, message):
    with pytest.raises(InvalidRequestError, match=message):
        ChunkSchedule.parse(spec)


@pytest.mark.parametrize("num_tokens, rows_before, align, expected", [
    (300, 0, 64, 256),   # rounded down to the alignment
    (256, 0, 64, 256),
    (48, 0, 64, 16),     # less than the alignment fits: one block, never 0
    (15, 0, 64, 0),      # not even a block
    (300, 32, 64, 224),  # 32 decodes + 224 = 256 rows: the step is aligned too
    (300, 8, 64, 256),   # 8 + x can not be a multiple of 64 with whole blocks: the chunk alone is
    (64, 48, 64, 16),    # 48 + 16 = 64
    (64, 16, 16, 64),    # already aligned
])
def test_align_chunk(num_tokens, rows_before, align, expected):
    assert align_chunk(num_tokens, rows_before, align, block_size=16) == expected

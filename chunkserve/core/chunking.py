"""How long a prompt chunk is: Sarathi-Serve's decreasing schedule and tile alignment.

The scheduler asks two questions of this module for every prompt chunk it cuts:

- `ChunkSchedule.step_tokens(num_prefilled)`: with `--chunk-schedule high:low:stages:max_tokens`
  a request's step may hold at most `high` tokens while its prompt is young, stepping down
  linearly to `low` over `stages` equal stages of `max_tokens / stages` prompt tokens each.
  Later chunks attend over more earlier keys, so each of their tokens costs more; a smaller
  chunk keeps the step time (and so every running decode's TBT) level across the prompt.
- `align_chunk(...)`: a chunk that does not finish its prompt is rounded down to a multiple
  of `--chunk-align` tokens (never below one KV block), and shortened a little further when
  that makes the step's total rows (decodes + chunks) a multiple of the alignment too, so no
  step pays for a matmul tile it barely uses (Sarathi's 256 -> 257 rows example).
"""

from __future__ import annotations

from dataclasses import dataclass

from chunkserve.errors import InvalidRequestError


@dataclass(frozen=True)
class ChunkSchedule:
    high: int
    low: int
    stages: int
    max_tokens: int

    def __post_init__(self) -> None:
        if not 0 < self.low <= self.high:
            raise InvalidRequestError(f"chunk schedule needs 0 < low <= high, got low {self.low}, high {self.high}")
        if self.stages < 1 or self.max_tokens < self.stages:
            raise InvalidRequestError(
                f"chunk schedule needs stages >= 1 and max_tokens >= stages, got {self.stages} stages "
                f"over {self.max_tokens} tokens"
            )

    @classmethod
    def parse(cls, spec: str) -> ChunkSchedule:
        """'high:low:stages:max_tokens', e.g. '512:128:4:4096'."""
        parts = spec.split(":")
        if len(parts) != 4 or not all(p.strip().isdigit() for p in parts):
            raise InvalidRequestError(
                f"chunk schedule must be 'high:low:stages:max_tokens' (four integers), got {spec!r}"
            )
        high, low, stages, max_tokens = (int(p) for p in parts)
        return cls(high, low, stages, max_tokens)

    @property
    def tokens_per_stage(self) -> int:
        return -(-self.max_tokens // self.stages)

    def step_tokens(self, num_prefilled: int) -> int:
        """The most tokens a step may hold when it carries a chunk of a prompt whose first
        `num_prefilled` tokens are already computed."""
        stage = min(num_prefilled // self.tokens_per_stage, self.stages - 1)
        if self.stages == 1:
            return self.high
        return round(self.high - (self.high - self.low) * stage / (self.stages - 1))


def align_chunk(num_tokens: int, rows_before: int, align: int, block_size: int) -> int:
    """Round the length of a chunk that will not finish its prompt.

    `num_tokens` is the most that fits (its end already on a block boundary), `rows_before`
    the rows the step holds already. The result is a multiple of `align` (a multiple of the
    block size), or one block when not even `align` tokens fit; when shortening it by
    `rows_before % align` more keeps it whole blocks and at least one block, it is
    shortened so that the step's rows come to a multiple of `align`.
    """
    if num_tokens < block_size:
        return 0
    aligned = num_tokens // align * align
    if aligned == 0:
        return block_size
    overhang = rows_before % align
    if overhang and overhang % block_size == 0 and aligned - overhang >= block_size:
        return aligned - overhang
    return aligned

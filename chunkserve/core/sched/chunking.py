"""How long a prompt chunk is: the chunk policy.

`ChunkPolicy.chunk(...)` answers, for every prompt chunk the scheduler cuts, how many of a
request's tokens the step takes. The limits, in order:

- the step's remaining token budget (and, for a new request, its room in the KV pool);
- `long_prefill_token_threshold`, a cap per request per step;
- Sarathi-Serve's decreasing schedule (`--chunk-schedule high:low:stages:max_tokens`,
  `ChunkSchedule.step_tokens`): later chunks attend over more earlier keys, so each of their
  tokens costs more, and a smaller chunk keeps the step time (and so every running decode's
  TBT) level across the prompt;
- with `--tbt-slo-ms`, the step-time model (step_predictor.py): as many tokens as keep the
  step's predicted time, times the model's safety margin, under the SLO (a chunk is charged the
  images it would encode, `encoder_embeds`);
- alignment (`align_chunk`): a chunk that does not finish its prompt is rounded down to a
  multiple of `--chunk-align` tokens (never below one KV block), and shortened a little
  further when that makes the step's total rows (decodes + chunks) a multiple of the
  alignment too, so no step pays for a matmul tile it barely uses (Sarathi's 256 -> 257 rows).
  Alignment never starves a prompt: where the room left is less than the rest of a block
  (a budget of one block beside a decode), the chunk takes that room, cut at any token as
  vLLM cuts.

The prefill-wait guard (a starvation guard) belongs to the same policy: under a TBT SLO the
decodes alone may fill a step, and a prompt would then never get a token. One prompt per step
that has had no tokens for longer than `max_prefill_wait_ms` gets one aligned chunk past the
SLO (`prefill_wait_guard`, on the chunk, the step and its record).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chunkserve.config.scheduler import SchedulerConfig
from chunkserve.core.request import Request
from chunkserve.core.step_predictor import StepTimePredictor

if TYPE_CHECKING:
    from chunkserve.core.sched.step_builder import StepBuilder


@dataclass(frozen=True)
class Chunk:
    num_tokens: int  # 0: nothing this step
    prefill_wait_guard: bool = False  # granted by the prefill-wait guard beyond the TBT SLO


class ChunkPolicy:
    """Sizes prompt chunks (see the module docstring) and keeps the prefill-wait guard's clock:
    when each prompt last got tokens (or arrived)."""

    def __init__(self, config: SchedulerConfig, predictor: StepTimePredictor | None,
                 encoder_embeds: Callable[[Request, int, int], int] | None = None) -> None:
        """`encoder_embeds(request, start, num_tokens)`: the encoder output rows such a chunk would
        compute (its images not cached), for the step-time model."""
        self.config = config
        self.predictor = predictor
        self._encoder_embeds = encoder_embeds
        self._last_progress: dict[str, float] = {}

    def track(self, request_id: str, now: float) -> None:
        """The prompt got tokens (or arrived, or was preempted) at `now`."""
        self._last_progress[request_id] = now

    def forget(self, request_id: str) -> None:
        self._last_progress.pop(request_id, None)

    def registry_sizes(self) -> dict[str, int]:
        return {"last_progress": len(self._last_progress)}

    def chunk(self, request: Request, start: int, room: int, step: StepBuilder) -> Chunk:
        """How many of the request's tokens after `start` this step takes: all of them, or an
        aligned chunk, or all the room when no block boundary lies within it; 0 when there is
        no room, chunking is off, or the TBT SLO leaves no block. `room` is what else limits
        it (KV blocks for a new request)."""
        remaining = request.num_tokens - start
        config = self.config
        limit = min(room, step.budget)
        if config.enable_chunked_prefill and config.long_prefill_token_threshold:
            limit = min(limit, config.long_prefill_token_threshold)
        if config.enable_chunked_prefill and config.chunk_schedule is not None:
            limit = min(limit, config.chunk_schedule.step_tokens(start) - step.num_rows)
        slo_limit = self._slo_limit(request, step, start, limit)
        num_tokens = self._cut(remaining, start, min(limit, slo_limit), step.num_rows)
        if num_tokens == 0 and slo_limit >= limit > 0 and config.enable_chunked_prefill:
            return Chunk(limit)  # no block boundary within the room: unaligned, rather than never
        if num_tokens == 0 and slo_limit < limit and self._prefill_wait_guard_fires(request, step):
            return Chunk(self._cut(remaining, start, min(limit, config.chunk_alignment), step.num_rows),
                         prefill_wait_guard=True)
        return Chunk(num_tokens)

    def _cut(self, remaining: int, start: int, limit: int, rows_before: int) -> int:
        if remaining <= limit:
            return remaining
        if not self.config.enable_chunked_prefill or limit <= 0:
            return 0
        block_size = self.config.block_size
        fits = (start + limit) // block_size * block_size - start
        if start % block_size:  # after a chunk cut at any token: back onto a block boundary
            return max(fits, 0)
        return align_chunk(fits, rows_before, self.config.chunk_alignment, block_size)

    def _slo_limit(self, request: Request, step: StepBuilder, start: int, limit: int) -> int:
        """The most tokens (up to `limit`) a chunk from `start` may have for the step's predicted
        time, times the model's safety margin, to stay within the TBT SLO; `limit` when there
        is no SLO or no model yet."""
        slo_ms = self.config.tbt_slo_ms
        if slo_ms is None or self.predictor is None or not self.predictor.fitted or limit <= 0:
            return limit
        slo = slo_ms / 1000 / self.predictor.margin

        def fits(num_tokens: int) -> bool:
            shape = step.shape.plus(start, num_tokens)
            if self._encoder_embeds is not None and request.mm_features:
                shape = shape.plus_encoder(self._encoder_embeds(request, start, num_tokens))
            return self.predictor.predict(shape) <= slo

        if fits(limit):
            return limit
        low, high = 0, limit  # fits(low) is assumed (0 adds nothing); fits(high) is False
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        return low

    def _prefill_wait_guard_fires(self, request: Request, step: StepBuilder) -> bool:
        """The prefill-wait guard fires for at most one prompt per step, one that got no tokens
        for longer than `max_prefill_wait_ms`."""
        waited = step.now - self._last_progress[request.request_id]
        return not step.prefill_wait_guard and waited * 1000 > self.config.max_prefill_wait_ms


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

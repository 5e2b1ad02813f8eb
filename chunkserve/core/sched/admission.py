"""Who gets prompt tokens first, and whether a prompt may be left unfinished.

Prompts in progress and waiting prompts are served in arrival order (fcfs) or by priority
(lower value first, then arrival). With `ttft_slo_ms`, those that can still meet their
first-token deadline go first, earliest deadline first, within the priority classes. A
waiting prompt held back only by the partial-prefill limits (`max_num_partial_prefills`,
`max_long_partial_prefills`) is passed by the prompts behind it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import TYPE_CHECKING

from chunkserve.config.scheduler import SchedulerConfig
from chunkserve.core.request import Request
from chunkserve.core.step_predictor import StepShape, StepTimePredictor

if TYPE_CHECKING:
    from chunkserve.core.sched.step_builder import StepBuilder


class Admission(enum.Enum):
    """What admitting one waiting request came to."""

    ADMITTED = "admitted"
    SKIPPED = "skipped"  # not now, but requests behind it may be admitted
    STOP = "stop"  # nothing behind it can be admitted either (no slot, budget or KV room)


class AdmissionPolicy:
    def __init__(self, config: SchedulerConfig, predictor: StepTimePredictor | None) -> None:
        self.config = config
        self.predictor = predictor

    def order(self, in_progress: list[Request], waiting: Iterable[Request], now: float) -> list[Request]:
        """Prompts in progress, then waiting ones in queue order; with a TTFT SLO, all by urgency."""
        candidates = in_progress + self.queue_order(waiting)
        if self.config.ttft_slo_ms is not None:
            candidates.sort(key=lambda r: self._ttft_urgency(r, now))
        return candidates

    def queue_order(self, waiting: Iterable[Request]) -> list[Request]:
        if self.config.scheduling_policy == "priority":
            return sorted(waiting, key=lambda r: (r.priority, r.arrival_time))
        return list(waiting)

    def may_leave_partial(self, request: Request, running: list[Request], step: StepBuilder) -> bool:
        """Whether admitting `request` with an unfinished prompt keeps within the limits on
        prompts left unfinished at the end of the step (all, and long ones). `running`: the
        running requests (those computing their prompts are enough)."""
        partial = long_partial = 0
        for other in running:
            computed = other.num_computed_tokens + step.num_tokens_of(other.request_id)
            if not other.is_decoding and computed < other.num_tokens:
                partial += 1
                long_partial += self._is_long(other)
        if partial >= self.config.max_num_partial_prefills:
            return False
        return not self._is_long(request) or long_partial < self.config.max_long_partial_prefills

    def _is_long(self, request: Request) -> bool:
        threshold = self.config.long_prefill_token_threshold
        return 0 < threshold < request.num_prompt_tokens

    def _ttft_urgency(self, request: Request, now: float) -> tuple:
        """Sort key with a TTFT SLO: prompts that can still make their deadline first (earliest
        deadline first), then the rest; within the priority policy's classes."""
        deadline = request.arrival_time + self.config.ttft_slo_ms / 1000
        remaining = StepShape().plus(request.num_computed_tokens, request.num_tokens - request.num_computed_tokens)
        # its images not in its KV yet, each as if encoded (the encoder cache may hold some: an upper bound)
        remaining = remaining.plus_encoder(sum(f.num_embeds for f in request.mm_features
                                               if f.end > request.num_computed_tokens))
        predicted = self.predictor.predict(remaining) if self.predictor is not None else None
        hopeless = now + (predicted or 0.0) > deadline
        priority = request.priority if self.config.scheduling_policy == "priority" else 0
        return priority, hopeless, deadline

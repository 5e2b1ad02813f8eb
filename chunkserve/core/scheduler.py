"""The stall-free chunked-prefill scheduler (vLLM V1's data model, Sarathi-Serve's order).

NOTE: there is no prefill phase and no decode phase. Every request carries
`num_computed_tokens` and `num_tokens`; each step hands out tokens so the first catches up
with the second, under one token budget (`max_num_batched_tokens`). The order is
Sarathi-Serve's stall-free one:

  1. every running request that is decoding gets its one token,
  2. running requests in the middle of a chunked prompt continue,
  3. waiting requests are admitted while budget, sequence slots and KV blocks last.

A prompt chunk that does not finish its prompt ends on a block boundary, so chunks are
whole pages. With prefix caching, an admitted request starts after the longest cached run of
blocks that begins its tokens, and every block becomes cacheable once its KV is computed.

When the pool runs dry while growing a running request, the least important unscheduled
running request is preempted: its blocks are released, its computed count is reset and it
waits at the head of the queue; its output tokens are kept and recomputed (from its own
blocks, if the prefix cache still holds them).

How long a prompt chunk is (chunking.py): the remaining budget, capped per request by
`long_prefill_token_threshold`, by Sarathi-Serve's decreasing schedule (`chunk_schedule`) and,
with `tbt_slo_ms`, by the step-time model (step_predictor.py): as many tokens as keep the
step's predicted time under the SLO. A chunk that does not finish its prompt is then aligned
(`chunk_align`). Prompts in progress and waiting prompts are served in arrival (or priority)
order; with `ttft_slo_ms`, those that can still meet their first-token deadline go first,
earliest deadline first. A waiting prompt held back only by the partial-prefill limits
(`max_num_partial_prefills`, `max_long_partial_prefills`) is passed by the prompts behind it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from chunkserve.config import SchedulerConfig
from chunkserve.core.chunking import align_chunk
from chunkserve.core.kv_cache_manager import KVCacheManager
from chunkserve.core.request import Request, RequestStatus
from chunkserve.core.scheduler_output import (
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)
from chunkserve.core.step_predictor import StepShape, StepTimePredictor
from chunkserve.core.stop import check_stop


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_blocks: int, predictor: StepTimePredictor | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        """`predictor` is the step-time model the TBT and TTFT SLOs consult (the engine feeds
        it); `clock` is the wall clock that request arrival times use."""
        self.config = config
        self.predictor = predictor
        self._clock = clock
        self._prefill_wait_since: dict[str, float] = {}  # last time each prompt got tokens (or arrived)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self._admission_seq: dict[str, int] = {}
        self._next_admission = 0
        self._known_to_runner: set[str] = set()
        self._finished_since_last_step: set[str] = set()
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens of requests admitted for the first time (cumulative)
        self.prefix_cache_hits = 0  # of those, found in the prefix cache

    # ----- queue management ---------------------------------------------------------

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id!r}"
        self.requests[request.request_id] = request
        self._prefill_wait_since[request.request_id] = request.arrival_time
        self._enqueue_waiting(request, at_front=False)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (e.g. abort) requests wherever they are; frees their blocks at once."""
        assert status.is_finished, f"{status} is not a finished status"
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request in self.running:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preempted_waiting=sum(r.status == RequestStatus.PREEMPTED for r in self.waiting),
            num_free_blocks=self.kv.num_free_blocks,
            num_blocks=self.kv.num_blocks,
            num_preemptions_total=self.num_preemptions,
            prefix_cache_queries_total=self.prefix_cache_queries,
            prefix_cache_hits_total=self.prefix_cache_hits,
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any request is unfinished."""
        return not self.has_unfinished_requests() and self.kv.reset_prefix_cache()

    # ----- one step -----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        step = _StepBuilder(self.config.max_num_batched_tokens, self._clock())
        if self.config.enable_mixed_batch:
            self._schedule_decodes(step)
            self._schedule_prefills(step)
        else:
            self._schedule_prefills(step)
            if not step.scheduled:
                self._schedule_decodes(step)

        new_requests = [
            self._new_request_data(self.requests[s.request_id])
            for s in step.scheduled
            if s.request_id not in self._known_to_runner
        ]
        self._known_to_runner.update(r.request_id for r in new_requests)
        self.prefix_cache_queries += step.prefix_cache_queries
        self.prefix_cache_hits += step.prefix_cache_hits
        finished, self._finished_since_last_step = self._finished_since_last_step, set()
        return SchedulerOutput(
            scheduled=step.scheduled,
            new_requests=new_requests,
            finished_request_ids=finished,
            preempted_request_ids=step.preempted,
            prefix_cache_queries=step.prefix_cache_queries,
            prefix_cache_hits=step.prefix_cache_hits,
            predicted_duration_s=self.predictor.predict(step.shape) if self.predictor else None,
            prefill_wait_guard=step.guard_fired,
        )

    def update_from_output(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Advance the counters by what was computed, append sampled tokens, apply stops.

        Returns the requests that received a token (finished ones included).
        """
        updated = []
        for scheduled in output.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is None or request.is_finished:
                continue
            request.num_computed_tokens += scheduled.num_scheduled_tokens
            self.kv.cache_computed_blocks(request)
            token_id = runner_output.sampled_token_ids.get(scheduled.request_id)
            if token_id is None:
                continue
            request.output_token_ids.append(token_id)
            status = check_stop(request, self.config.max_model_len)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            updated.append(request)
        return updated

    # ----- the three phases -----------------------------------------------------------

    def _schedule_decodes(self, step: _StepBuilder) -> None:
        for request in list(self.running):
            if request.is_decoding and not step.is_taken(request.request_id):
                if step.budget < 1:
                    break
                self._schedule_running(request, 1, step)

    def _schedule_prefills(self, step: _StepBuilder) -> None:
        """Prompts in progress, then waiting ones (or, with a TTFT SLO, by urgency)."""
        in_progress = [r for r in self.running if not r.is_decoding and not step.is_taken(r.request_id)]
        candidates = in_progress + self._waiting_in_order()
        if self.config.ttft_slo_ms is not None:
            candidates.sort(key=lambda r: self._ttft_urgency(r, step.now))
        admitting = True
        for request in candidates:
            if step.is_taken(request.request_id):  # preempted for an earlier one: it waits
                continue
            if request.status == RequestStatus.RUNNING:
                num_tokens = self._chunk_len(request, request.num_computed_tokens, step.budget, step)
                if num_tokens > 0:
                    self._schedule_running(request, num_tokens, step)
            elif admitting:
                admitting = self._admit(request, step)

    def _admit(self, request: Request, step: _StepBuilder) -> bool:
        """Admit a waiting request if it fits; False when nothing behind it can be admitted
        either (no sequence slot, budget or KV room), True to go on to the next one."""
        if len(self.running) >= self.config.max_num_seqs or step.budget < 1:
            return False
        cached_blocks, num_cached = self.kv.get_computed_blocks(request)
        kv_room = self.kv.num_available_blocks(cached_blocks) * self.config.block_size
        num_tokens = self._chunk_len(request, num_cached, kv_room - num_cached, step)
        if num_tokens == 0:
            return False
        if num_cached + num_tokens < request.num_tokens and not self._may_leave_partial(request, step):
            return True  # held back by the partial-prefill limits: shorter prompts behind may pass
        if self.kv.allocate_slots(request.request_id, num_cached + num_tokens, cached_blocks) is None:
            return False  # no preemption to admit new work: wait for blocks to come back
        self.waiting.remove(request)
        request.num_computed_tokens = num_cached
        if request.num_cached_tokens is None:
            request.num_cached_tokens = num_cached
        if request.num_preemptions == 0:  # a recompute finding its own blocks is not prefix reuse
            step.count_prefix_query(request.num_tokens, num_cached)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._admission_seq[request.request_id] = self._next_admission
        self._next_admission += 1
        self._add_to_step(request, num_tokens, step)
        return True

    # ----- helpers --------------------------------------------------------------------

    def _chunk_len(self, request: Request, start: int, room: int, step: _StepBuilder) -> int:
        """How many of the request's tokens after `start` this step takes: all of them, or an
        aligned chunk, or 0 when not even one block fits (or chunking is off). `room` is
        what else limits it (KV blocks for a new request)."""
        remaining = request.num_tokens - start
        config = self.config
        limit = min(room, step.budget)
        if config.enable_chunked_prefill and config.long_prefill_token_threshold:
            limit = min(limit, config.long_prefill_token_threshold)
        if config.enable_chunked_prefill and config.chunk_schedule is not None:
            limit = min(limit, config.chunk_schedule.step_tokens(start) - step.num_rows)
        slo_limit = self._slo_limit(step, start, limit)
        num_tokens = self._cut(remaining, start, min(limit, slo_limit), step)
        if num_tokens == 0 and slo_limit < limit and self._waited_too_long(request, step):
            step.guarded_request_id = request.request_id  # fires if the chunk is scheduled
            return self._cut(remaining, start, min(limit, config.chunk_alignment), step)
        return num_tokens

    def _cut(self, remaining: int, start: int, limit: int, step: _StepBuilder) -> int:
        if remaining <= limit:
            return remaining
        if not self.config.enable_chunked_prefill or limit <= 0:
            return 0
        block_size = self.config.block_size
        fits = (start + limit) // block_size * block_size - start
        return align_chunk(fits, step.num_rows, self.config.chunk_alignment, block_size)

    def _slo_limit(self, step: _StepBuilder, start: int, limit: int) -> int:
        """The most tokens (up to `limit`) a chunk from `start` may have for the step's predicted
        time, times the model's safety margin, to stay within the TBT SLO; `limit` when there
        is no SLO or no model yet."""
        slo_ms = self.config.tbt_slo_ms
        if slo_ms is None or self.predictor is None or not self.predictor.fitted or limit <= 0:
            return limit
        slo = slo_ms / 1000 / self.predictor.margin

        def fits(num_tokens: int) -> bool:
            return self.predictor.predict(step.shape.plus(start, num_tokens)) <= slo

        if fits(limit):
            return limit
        low, high = 0, limit  # fits(low) is assumed (0 adds nothing); fits(high) is False
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if fits(middle) else (low, middle)
        return low

    def _waited_too_long(self, request: Request, step: _StepBuilder) -> bool:
        """The starvation guard: one prompt per step that got no tokens for longer than
        `max_prefill_wait_ms` gets a chunk even though the step then exceeds the SLO."""
        waited = step.now - self._prefill_wait_since[request.request_id]
        return not step.guard_fired and waited * 1000 > self.config.max_prefill_wait_ms

    def _schedule_running(self, request: Request, num_tokens: int, step: _StepBuilder) -> None:
        """Schedule a running request, preempting others (or, as a last resort, itself)
        until its blocks fit."""
        total = request.num_computed_tokens + num_tokens
        while self.kv.allocate_slots(request.request_id, total) is None:
            victim = self._pick_victim(request, step)
            self._preempt(victim, step)
            if victim is request:
                return
        self._add_to_step(request, num_tokens, step)

    def _add_to_step(self, request: Request, num_tokens: int, step: _StepBuilder) -> None:
        if not request.is_decoding:
            self._prefill_wait_since[request.request_id] = step.now
            step.guard_fired |= step.guarded_request_id == request.request_id
        step.add(request, num_tokens, self.kv.block_table(request.request_id))

    def _pick_victim(self, request: Request, step: _StepBuilder) -> Request:
        candidates = [r for r in self.running if not step.is_taken(r.request_id)]
        if self.config.scheduling_policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return max(candidates, key=lambda r: self._admission_seq[r.request_id])

    def _preempt(self, request: Request, step: _StepBuilder) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self._prefill_wait_since[request.request_id] = step.now
        self.num_preemptions += 1
        step.preempted.add(request.request_id)
        self._enqueue_waiting(request, at_front=True)

    def _may_leave_partial(self, request: Request, step: _StepBuilder) -> bool:
        """Whether admitting `request` with an unfinished prompt keeps within the limits on
        prompts left unfinished at the end of the step (all, and long ones)."""
        partial = long_partial = 0
        for running in self.running:
            computed = running.num_computed_tokens + step.num_tokens_of(running.request_id)
            if not running.is_decoding and computed < running.num_tokens:
                partial += 1
                long_partial += self._is_long(running)
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
        predicted = self.predictor.predict(remaining) if self.predictor is not None else None
        hopeless = now + (predicted or 0.0) > deadline
        priority = request.priority if self.config.scheduling_policy == "priority" else 0
        return priority, hopeless, deadline

    def _enqueue_waiting(self, request: Request, at_front: bool) -> None:
        if at_front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def _waiting_in_order(self) -> list[Request]:
        if self.config.scheduling_policy == "priority":
            return sorted(self.waiting, key=lambda r: (r.priority, r.arrival_time))
        return list(self.waiting)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request.request_id)
        self._admission_seq.pop(request.request_id, None)
        self._prefill_wait_since.pop(request.request_id, None)
        del self.requests[request.request_id]
        if request.request_id in self._known_to_runner:
            self._known_to_runner.discard(request.request_id)
            self._finished_since_last_step.add(request.request_id)

    @staticmethod
    def _new_request_data(request: Request) -> NewRequestData:
        return NewRequestData(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
        )


class _StepBuilder:
    """The step being assembled: the remaining token budget and who got what."""

    def __init__(self, budget: int, now: float) -> None:
        self.budget = budget
        self.now = now
        self.num_rows = 0
        self.shape = StepShape()
        self.guard_fired = False  # a prompt got tokens past the TBT SLO (it had waited too long)
        self.guarded_request_id: str | None = None
        self.scheduled: list[ScheduledRequest] = []
        self.preempted: set[str] = set()
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._num_tokens: dict[str, int] = {}

    def count_prefix_query(self, num_tokens: int, num_cached: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += num_cached

    def is_taken(self, request_id: str) -> bool:
        """Already scheduled or preempted in this step."""
        return request_id in self._num_tokens or request_id in self.preempted

    def num_tokens_of(self, request_id: str) -> int:
        return self._num_tokens.get(request_id, 0)

    def add(self, request: Request, num_tokens: int, block_table: list[int]) -> None:
        assert 0 < num_tokens <= self.budget, f"{num_tokens} tokens exceed the step budget {self.budget}"
        self.budget -= num_tokens
        self.num_rows += num_tokens
        self.shape = self.shape.plus(request.num_computed_tokens, num_tokens)
        self._num_tokens[request.request_id] = num_tokens
        self.scheduled.append(
            ScheduledRequest(
                request_id=request.request_id,
                num_computed_tokens=request.num_computed_tokens,
                num_scheduled_tokens=num_tokens,
                block_table=list(block_table),
                sample=request.num_computed_tokens + num_tokens == request.num_tokens,
                is_decode=request.is_decoding,
            )
        )

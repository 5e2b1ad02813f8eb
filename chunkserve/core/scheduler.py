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
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from chunkserve.config import SchedulerConfig
from chunkserve.core.kv_cache_manager import KVCacheManager
from chunkserve.core.request import Request, RequestStatus
from chunkserve.core.scheduler_output import (
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)
from chunkserve.core.stop import check_stop


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_blocks: int) -> None:
        self.config = config
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
        step = _StepBuilder(self.config.max_num_batched_tokens)
        if self.config.enable_mixed_batch:
            self._schedule_decodes(step)
            self._schedule_partial_prefills(step)
            self._schedule_waiting(step)
        else:
            self._schedule_partial_prefills(step)
            self._schedule_waiting(step)
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

    def _schedule_partial_prefills(self, step: _StepBuilder) -> None:
        for request in list(self.running):
            if request.is_decoding or step.is_taken(request.request_id):
                continue
            num_tokens = self._chunk_len(request, request.num_computed_tokens, step.budget)
            if num_tokens > 0:
                self._schedule_running(request, num_tokens, step)

    def _schedule_waiting(self, step: _StepBuilder) -> None:
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self._peek_waiting()
            cached_blocks, num_cached = self.kv.get_computed_blocks(request)
            kv_room = self.kv.num_available_blocks(cached_blocks) * self.config.block_size
            num_tokens = self._chunk_len(request, num_cached, min(step.budget, kv_room - num_cached))
            if num_tokens == 0:
                break
            leaves_partial = num_cached + num_tokens < request.num_tokens
            if leaves_partial and self._num_partial_prefills(step) >= self.config.max_num_partial_prefills:
                break
            if self.kv.allocate_slots(request.request_id, num_cached + num_tokens, cached_blocks) is None:
                break  # no preemption to admit new work: wait for blocks to come back
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
            step.add(request, num_tokens, self.kv.block_table(request.request_id))

    # ----- helpers --------------------------------------------------------------------

    def _chunk_len(self, request: Request, start: int, budget: int) -> int:
        """How many of the request's tokens after `start` fit in this step: all of them, or
        a block-aligned chunk, or 0 when not even one block fits (or chunking is off)."""
        remaining = request.num_tokens - start
        num_tokens = min(remaining, budget)
        if self.config.enable_chunked_prefill and self.config.long_prefill_token_threshold:
            num_tokens = min(num_tokens, self.config.long_prefill_token_threshold)
        if num_tokens == remaining:
            return num_tokens
        if not self.config.enable_chunked_prefill:
            return 0
        block_size = self.config.block_size
        chunk_end = (start + num_tokens) // block_size * block_size
        return max(chunk_end - start, 0)

    def _schedule_running(self, request: Request, num_tokens: int, step: _StepBuilder) -> None:
        """Schedule a running request, preempting others (or, as a last resort, itself)
        until its blocks fit."""
        total = request.num_computed_tokens + num_tokens
        while self.kv.allocate_slots(request.request_id, total) is None:
            victim = self._pick_victim(request, step)
            self._preempt(victim, step)
            if victim is request:
                return
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
        self.num_preemptions += 1
        step.preempted.add(request.request_id)
        self._enqueue_waiting(request, at_front=True)

    def _num_partial_prefills(self, step: _StepBuilder) -> int:
        """Running requests that will still be mid-prompt after this step."""
        count = 0
        for request in self.running:
            computed = request.num_computed_tokens + step.num_tokens_of(request.request_id)
            if not request.is_decoding and computed < request.num_tokens:
                count += 1
        return count

    def _enqueue_waiting(self, request: Request, at_front: bool) -> None:
        if at_front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def _peek_waiting(self) -> Request:
        if self.config.scheduling_policy == "priority":
            return min(self.waiting, key=lambda r: (r.priority, r.arrival_time))
        return self.waiting[0]

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv.free(request.request_id)
        self._admission_seq.pop(request.request_id, None)
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

    def __init__(self, budget: int) -> None:
        self.budget = budget
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

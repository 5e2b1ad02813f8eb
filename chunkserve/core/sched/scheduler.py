"""The stall-free chunked-prefill scheduler (vLLM V1's data model, Sarathi-Serve's order).

NOTE: there is no prefill phase and no decode phase. Every request carries
`num_computed_tokens` and `num_tokens`; each step hands out tokens so the first catches up
with the second, under one token budget (`max_num_batched_tokens`). The order is
Sarathi-Serve's stall-free one:

  1. every running request that is decoding gets its token (plus its draft tokens, if
     speculative decoding proposed some and the budget allows),
  2. running requests in the middle of a chunked prompt continue,
  3. waiting requests are admitted while budget, sequence slots and KV blocks last.

How long a prompt chunk is belongs to the chunk policy (chunking.py), who goes first to the
admission policy (admission.py), whom to preempt to the preemption policy (preemption.py).
A prompt chunk that does not finish its prompt ends on a block boundary where one lies within
the step's room, so chunks are whole pages (chunking.py). With prefix caching, an admitted request starts after the longest cached run of
blocks that begins its tokens (and after what the KV connector can supply), and every block
becomes cacheable once its tokens are computed and verified.

When the pool runs dry while growing a running request, a running request is preempted:
its blocks are released, its computed count is reset and it waits at the head of the queue;
its output tokens are kept and recomputed (from its own blocks, if the prefix cache still
holds them). Admission avoids thrash: a new request leaves one block per running request
free (what their next tokens may need), and a preempted request comes back only when the pool
can hold it to its `max_tokens` (or nothing else runs), instead of being admitted and
preempted over and over.

After the step, `update_from_output` advances each request by what was computed, rolls back
the drafts the model rejected, appends the accepted tokens and applies the token-level stops,
and reports per request only what is new (`EngineCoreOutput`).

With pipeline parallelism (`max_steps_in_flight` > 1) the next steps are scheduled before the
last one's output is back: a request's computed count advances when it is scheduled (and goes
back if its step is voided; a preemption resets it), a request whose step samples is not
scheduled again until its token is back, and a prompt's next chunk may ride the next step,
since every stage runs the steps in order and finds the chunk before it in its KV.

Structured outputs (a grammar per request, core/structured/): a request waits, without holding
anyone up, until its grammar is compiled; each row that samples gets its grammar's token
bitmask (drafts are first cut at the first token the grammar refuses); the grammar advances by
the accepted tokens only, and a grammar that is complete finishes its request.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from chunkserve.config.scheduler import SchedulerConfig
from chunkserve.core.kv.kv_cache_manager import KVCacheManager
from chunkserve.core.kv_connector import KVConnectorScheduler, NoOpConnector
from chunkserve.core.request import Request, RequestStatus
from chunkserve.core.sched.admission import Admission, AdmissionPolicy
from chunkserve.core.sched.chunking import Chunk, ChunkPolicy
from chunkserve.core.sched.output import (
    EngineCoreOutput,
    KVTierStats,
    KVTransferStats,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
)
from chunkserve.core.sched.preemption import pick_victim
from chunkserve.core.sched.step_builder import StepBuilder
from chunkserve.core.spec.ngram import NgramProposer
from chunkserve.core.spec.policy import DecodeLoad, DraftPolicy
from chunkserve.core.step_predictor import StepTimePredictor
from chunkserve.core.stop import check_stop
from chunkserve.core.structured.manager import GrammarError, StructuredOutputManager
from chunkserve.errors import InvalidRequestError, ServerOverloadedError


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_blocks: int, predictor: StepTimePredictor | None = None,
                 clock: Callable[[], float] = time.time, kv_connector: KVConnectorScheduler | None = None,
                 structured: StructuredOutputManager | None = None) -> None:
        """`predictor` is the step-time model the TBT and TTFT SLOs consult (the engine feeds
        it); `clock` is the wall clock that request arrival times use; `structured` holds the
        requests' grammars (none: a request with structured_outputs is refused)."""
        self.config = config
        self.structured = structured
        self._grammar_errors: dict[str, str] = {}  # request id -> why its output left its grammar
        self.predictor = predictor
        self._clock = clock
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.connector = kv_connector or NoOpConnector()
        self.connector.bind_kv_cache(self.kv)
        self.chunking = ChunkPolicy(config, predictor)
        self.admission = AdmissionPolicy(config, predictor)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self._admission_order: dict[str, int] = {}
        self._next_admission = 0
        self._blocks_sent: dict[str, int] = {}  # blocks of each request's table the worker has
        self._known_to_worker: set[str] = set()
        self._resend_as_new: set[str] = set()  # new in a step that failed: the worker may not have them
        self._finished_since_last_step: set[str] = set()
        self._remote_kv_tokens: dict[str, int] = {}  # computed tokens once the connector's load lands
        # finished requests' blocks, held until the connector has sent them (oldest first per id)
        self._sending: dict[str, deque[list[int]]] = {}
        self._tokens_sent: dict[str, int] = {}  # with send_token_ids: tokens of each request the workers have
        # steps in flight (pipelined): each one's requests, as (the Request, its preemption count) when it was
        # scheduled: a result applies only to the same request (an id may be reused) not preempted since
        self._in_flight: dict[int, dict[str, tuple[Request, int]]] = {}
        self._awaiting_token: set[str] = set()  # pipelined: their sampling step is in flight
        # while the engine searches for the request that makes steps fail, only these run (the others
        # keep their blocks and wait); None: every request may run
        self.only: set[str] | None = None
        spec = config.speculative
        self.draft_policy = None if spec is None else DraftPolicy(spec, predictor)
        self.ngram = None if spec is None or spec.drafts_in_worker else NgramProposer(
            spec.prompt_lookup_min, spec.prompt_lookup_max, spec.num_speculative_tokens)
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens of requests admitted for the first time (cumulative)
        self.prefix_cache_hits = 0  # of those, found in the prefix cache

    # ----- queue management ---------------------------------------------------------

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id!r}"
        self._start_grammar(request)
        self.requests[request.request_id] = request
        self.chunking.track(request.request_id, request.arrival_time)
        self.waiting.append(request)

    def import_request(self, request: Request, block_hashes: list[bytes],
                       has_payload: list[bool]) -> list[tuple[int, int]]:
        """Take a request from another engine (a snapshot) with `request.num_computed_tokens`
        already computed: its full blocks are named by `block_hashes`, and `has_payload[i]` says
        whether block i's KV came with it (the partial last block always does). Blocks this pool
        caches are reused, the others allocated; returns the blocks to fill from the snapshot, as
        (block id, snapshot block index). The caller fills them, then registers the full ones in
        the prefix cache (`kv.cache_full_blocks`). Raises (taking nothing) when it cannot run here
        now."""
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        num_computed = request.num_computed_tokens
        cached = []
        if self.kv.enable_caching:
            for block_hash in block_hashes:
                block_id = self.kv.pool.lookup(block_hash)
                if block_id is None:
                    break
                cached.append(block_id)
        num_blocks = self.kv.num_blocks_for(num_computed)
        missing = [i for i in range(len(cached), num_blocks) if not has_payload[i]]
        if missing:
            raise InvalidRequestError(f"snapshot block {missing[0]}'s KV was left out but this engine's prefix cache "
                                      "does not hold it after the blocks before it: export the request again with "
                                      "its payload")
        if num_computed and len(self.running) + len(self._remote_kv_tokens) >= self.config.max_num_seqs:
            raise ServerOverloadedError(f"{self.config.max_num_seqs} requests are already running; retry the "
                                        "import later")
        if num_computed and self.kv.allocate_slots(request.request_id, num_computed, cached) is None:
            raise ServerOverloadedError(f"the KV pool has no room for the imported request's {num_blocks} blocks "
                                        f"({self.kv.num_free_blocks} free); retry later")
        self._start_grammar(request)
        self.requests[request.request_id] = request
        self.chunking.track(request.request_id, request.arrival_time)
        if not num_computed:  # nothing computed yet: it waits like a new request
            request.status = RequestStatus.WAITING
            self.waiting.append(request)
            return []
        self._start_running(request)
        table = self.kv.block_table(request.request_id)
        return [(table[i], i) for i in range(len(cached), num_blocks)]

    def worker_has_state(self, request_id: str) -> bool:
        """Whether the worker holds the request's state (token history, generator) as it stands."""
        return request_id in self._known_to_worker and request_id not in self._resend_as_new

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish (e.g. abort) requests wherever they are; frees their blocks at once."""
        assert status.is_finished, f"{status} is not a finished status"
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def has_unfinished_requests(self) -> bool:
        """Requests waiting or running, or finished ones whose KV the connector is still sending,
        or connector work still pending (a KV tier's saves): the engine keeps stepping (an
        empty step still runs the worker's side of the connector) until all of it is done."""
        return bool(self.waiting or self.running or self._sending or self.connector.has_pending_work())

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
            spec_decode=None if self.draft_policy is None else self.draft_policy.stats(),
            **_connector_stats(self.connector.get_kv_connector_stats()),
        )

    def check(self) -> list[str]:
        """What is inconsistent between the queues, the requests and the KV pool (for the
        engine's self-check: every block held by a live request or free)."""
        problems = self.kv.check([table for tables in self._sending.values() for table in tables])
        queued = [r.request_id for r in [*self.waiting, *self.running]]
        if sorted(queued) != sorted(self.requests):
            problems.append(f"{len(self.requests)} requests known but {len(queued)} queued")
        return problems

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix: the pool's, and what the KV connector caches (with the
        disk tier, its files of this model are removed). Refused (False) while any request is
        unfinished (a tier's writes still in flight do not count: they are removed as they land)."""
        if self.waiting or self.running or self._sending or not self.kv.reset_prefix_cache():
            return False
        self.connector.reset_cache()
        return True

    def schedule_connector_only(self) -> SchedulerOutput:
        """A step that computes nothing and carries only the KV connector's metadata (its
        saves, loads and cancels), to settle the connector outside the normal steps (at
        shutdown); run it and pass its output to `update_from_output` as any step's."""
        output = SchedulerOutput(scheduled=[], new_requests=[])
        output.kv_connector_metadata = self.connector.build_connector_meta(output)
        return output

    # ----- one step -----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        step = StepBuilder(self.config.max_num_batched_tokens, self._clock())
        if self.draft_policy is not None and self.ngram is None:
            step.decode_load = self._decode_load()
        if self.config.enable_mixed_batch:
            self._schedule_decodes(step)
            self._schedule_prefills(step)
        else:
            self._schedule_prefills(step)
            if not step.scheduled:
                self._schedule_decodes(step)

        new_requests = [self._new_request_data(self.requests[s.request_id]) for s in step.scheduled
                        if s.request_id not in self._known_to_worker or s.request_id in self._resend_as_new]
        self._known_to_worker.update(r.request_id for r in new_requests)
        self._resend_as_new.difference_update(r.request_id for r in new_requests)
        if self.config.send_token_ids:
            self._attach_new_tokens(step.scheduled, {r.request_id for r in new_requests})
        self.prefix_cache_queries += step.prefix_cache_queries
        self.prefix_cache_hits += step.prefix_cache_hits
        mask_seconds = self._fill_bitmasks(step.scheduled)
        finished, self._finished_since_last_step = self._finished_since_last_step, set()
        output = SchedulerOutput(
            scheduled=step.scheduled,
            new_requests=new_requests,
            finished_request_ids=finished,
            preempted_request_ids=step.preempted,
            prefix_cache_queries=step.prefix_cache_queries,
            prefix_cache_hits=step.prefix_cache_hits,
            predicted_duration_s=self.predictor.predict(step.shape) if self.predictor else None,
            prefill_wait_guard=step.past_slo,
            grammar_mask_s=mask_seconds,
        )
        output.kv_connector_metadata = self.connector.build_connector_meta(output)
        if self.pipelined and output.scheduled:
            self._in_flight[id(output)] = {s.request_id: (self.requests[s.request_id],
                                                          self.requests[s.request_id].num_preemptions)
                                           for s in output.scheduled}
        return output

    @property
    def pipelined(self) -> bool:
        return self.config.max_steps_in_flight > 1

    def _attach_new_tokens(self, scheduled: list[ScheduledRequest], new_ids: set[str]) -> None:
        """Each scheduled request's tokens the workers have not been sent yet (its latest sampled ones)."""
        for s in scheduled:
            request = self.requests[s.request_id]
            sent = self._tokens_sent.get(s.request_id)
            if s.request_id not in new_ids and sent is not None and sent < request.num_tokens:
                s.token_ids_from = sent
                s.new_token_ids = request.output_token_ids[sent - request.num_prompt_tokens:]
            self._tokens_sent[s.request_id] = request.num_tokens

    def _still_scheduled_as(self, output: SchedulerOutput, request: Request) -> bool:
        """Pipelined: whether `request` is as `output` scheduled it (not preempted since)."""
        scheduled_as = self._in_flight.get(id(output), {}).get(request.request_id)
        return scheduled_as is not None and scheduled_as[0] is request and scheduled_as[1] == request.num_preemptions

    def void_step(self, output: SchedulerOutput) -> None:
        """The step failed: nothing it scheduled was computed (the counters were never
        advanced), and the worker may or may not have applied its diffs, so what it carried
        is sent again: new requests as new (the worker replaces a state it has), block tables
        whole, finished requests again."""
        self._resend_as_new.update(new.request_id for new in output.new_requests)
        for scheduled in output.scheduled:
            self._blocks_sent.pop(scheduled.request_id, None)
            if scheduled.new_token_ids and scheduled.request_id in self._tokens_sent:
                self._tokens_sent[scheduled.request_id] = scheduled.token_ids_from
            request = self.requests.get(scheduled.request_id)
            if request is not None and self._still_scheduled_as(output, request):  # its count went ahead: back
                request.num_computed_tokens -= scheduled.num_scheduled_tokens
                if scheduled.sample:
                    self._awaiting_token.discard(request.request_id)
        self._in_flight.pop(id(output), None)
        self._finished_since_last_step |= output.finished_request_ids
        self.connector.step_failed(output.kv_connector_metadata)

    def update_from_output(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance the counters by what was computed and verified, append accepted tokens,
        apply the token-level stops. Returns what is new for every request that got tokens."""
        outputs = self._connector_progress(runner_output)
        continuing: list[Request] = []  # got tokens and runs on: its next drafts are proposed below
        for scheduled in output.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is None or request.is_finished:
                continue
            if self.pipelined:
                if not self._still_scheduled_as(output, request):  # preempted (or replaced) since: void
                    continue
                if scheduled.sample:
                    self._awaiting_token.discard(request.request_id)
            accepted = runner_output.sampled_token_ids.get(scheduled.request_id, [])
            rejected = len(scheduled.draft_token_ids) - (len(accepted) - 1) if accepted else 0
            assert rejected >= 0, f"{scheduled.request_id}: more tokens accepted than drafted"
            computed = scheduled.num_computed_tokens + scheduled.num_scheduled_tokens - rejected
            if not self.pipelined:  # (pipelined, it went ahead when scheduled)
                request.num_computed_tokens = computed
            request.spec_token_ids = []
            if not accepted:
                self.kv.cache_full_blocks(request, computed)
                continue
            if self.draft_policy is not None:
                self.draft_policy.observe(request.request_id, len(scheduled.draft_token_ids), len(accepted) - 1)
                self.draft_policy.observe_next_token(request.request_id, accepted[0])
            status = None
            for count, token_id in enumerate(accepted, 1):
                request.output_token_ids.append(token_id)
                status = check_stop(request, self.config.max_model_len)
                if status is not None:
                    break
            if status is None and self._has_grammar(request):
                status = self._advance_grammar(request, accepted[:count])
            # A stop inside an accepted run drops the tokens after it; none of them is computed.
            request.num_computed_tokens = min(computed, request.num_tokens - 1)
            self.kv.cache_full_blocks(request, request.num_computed_tokens)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            else:
                request.spec_token_ids = list(runner_output.draft_token_ids.get(request.request_id, ()))
                continuing.append(request)
            logprobs = runner_output.logprobs.get(request.request_id)
            output_now = self.output_of(request, accepted[:count], None if logprobs is None else logprobs[:count],
                                        runner_output.prompt_logprobs.get(request.request_id))
            error = self._grammar_errors.pop(request.request_id, None)
            outputs.append(output_now if error is None else output_now._replace(error=error))
        self._in_flight.pop(id(output), None)
        if self.ngram is not None and continuing:
            self._propose_ngrams(continuing)
        return outputs

    def _propose_ngrams(self, requests: list[Request]) -> None:
        """Each request's n-gram drafts for its next step, as many as the draft policy says pay
        (a proposal it does not get stays as its shadow, to keep its acceptance rate current)."""
        load = self._decode_load()
        for request in requests:
            proposal = self.ngram.propose(request.all_token_ids, self.config.max_model_len)
            k = self.draft_policy.num_drafts(request.request_id, len(proposal), load, request.num_computed_tokens)
            request.spec_token_ids = proposal[:k]
            self.draft_policy.set_shadow(request.request_id, proposal[0] if proposal and not k else None)

    def _decode_load(self) -> DecodeLoad:
        """The running requests' next decodes (those whose prompts are done), one row each."""
        return DecodeLoad.of([r.num_computed_tokens for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens])

    @staticmethod
    def output_of(request: Request, new_token_ids: list[int], new_logprobs=None,
                  new_prompt_logprobs=None) -> EngineCoreOutput:
        return EngineCoreOutput(
            request.request_id, new_token_ids, new_logprobs, request.status.finish_reason, request.stop_reason,
            request.num_cached_tokens or 0, request.num_preemptions, request.first_scheduled_time,
            new_prompt_logprobs=new_prompt_logprobs,
        )

    # ----- the three phases -----------------------------------------------------------

    def _schedule_decodes(self, step: StepBuilder) -> None:
        decoding = [r for r in self.running
                    if r.is_decoding and not step.is_taken(r.request_id) and self._schedulable(r)]
        for index, request in enumerate(decoding):
            if step.is_taken(request.request_id):  # preempted for an earlier one
                continue
            if step.budget < 1:
                break
            # drafts only from budget that every decode after this one still leaves
            drafts = self._drafts_that_fit(request, step.budget - (len(decoding) - index - 1))
            self._schedule_running(request, Chunk(1 + len(drafts)), step, drafts)

    def _schedule_prefills(self, step: StepBuilder) -> None:
        """Prompts in progress, then waiting ones, in the admission policy's order."""
        in_progress = [r for r in self.running
                       if not r.is_decoding and not step.is_taken(r.request_id) and self._schedulable(r)]
        waiting = (r for r in self.waiting if r.status != RequestStatus.WAITING_FOR_REMOTE_KVS and self._may_run(r)
                   and self._grammar_ready(r))
        admitting = True
        for request in self.admission.order(in_progress, waiting, step.now):
            if step.is_taken(request.request_id):  # preempted for an earlier one: it waits
                continue
            if request.status == RequestStatus.RUNNING:
                chunk = self.chunking.chunk(request, request.num_computed_tokens, step.budget, step)
                if chunk.num_tokens > 0:
                    self._schedule_running(request, chunk, step)
            elif admitting:
                admitting = self._admit(request, step) != Admission.STOP

    def _admit(self, request: Request, step: StepBuilder) -> Admission:
        """Admit a waiting request if it fits."""
        if len(self.running) + len(self._remote_kv_tokens) >= self.config.max_num_seqs or step.budget < 1:
            return Admission.STOP  # (requests loading remote KV hold a sequence slot already)
        cached_blocks, num_cached = self.kv.get_computed_blocks(request)
        if self.kv.next_block_in_flight(request, len(cached_blocks), self.running):
            return Admission.SKIPPED  # another request is computing its next block: it reads it from the cache later
        available = self.kv.num_available_blocks(cached_blocks)
        if request.num_preemptions and any(map(self._may_run, self.running)) and available < self.kv.num_blocks_for(
                request.num_prompt_tokens + request.max_tokens):
            return Admission.STOP  # it would only be preempted again: back when it can run to the end
        # the blocks running requests may take in this step are not the new request's to take
        kv_room = (available - len(self.running)) * self.config.block_size
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_cached)
        if num_external and load_async:
            if num_cached + num_external > kv_room:
                return Admission.STOP
            admission = self._await_remote_kv(request, cached_blocks, num_cached + num_external)
            if admission != Admission.STOP and request.num_preemptions == 0:
                step.count_prefix_query(request.num_tokens, num_cached)  # the pool's hit; the connector's apart
            return admission
        start = num_cached + num_external
        chunk = self.chunking.chunk(request, start, kv_room - start, step)
        if chunk.num_tokens == 0:
            return Admission.STOP
        if start + chunk.num_tokens < request.num_tokens and not self.admission.may_leave_partial(
                request, self.running, step):
            return Admission.SKIPPED  # held back by the partial-prefill limits: shorter prompts behind may pass
        if self.kv.allocate_slots(request.request_id, start + chunk.num_tokens, cached_blocks) is None:
            return Admission.STOP  # no preemption to admit new work: wait for blocks to come back
        if num_external:
            self.connector.update_state_after_alloc(request, self.kv.block_table(request.request_id), num_external)
        request.num_computed_tokens = start
        if request.num_cached_tokens is None:
            request.num_cached_tokens = start
        if request.num_preemptions == 0:  # a recompute finding its own blocks is not prefix reuse
            step.count_prefix_query(request.num_tokens, num_cached)
        self.waiting.remove(request)
        self._start_running(request)
        self._add_to_step(request, chunk, step, (), self._allocate_lookahead(request, chunk, step, []))
        return Admission.ADMITTED

    def _await_remote_kv(self, request: Request, cached_blocks: list[int], num_tokens: int) -> Admission:
        """The connector loads the request's KV asynchronously: hold its blocks while it
        waits, out of the step; it runs once the worker reports the load finished."""
        if self.kv.allocate_slots(request.request_id, num_tokens, cached_blocks) is None:
            return Admission.STOP
        self.connector.update_state_after_alloc(
            request, self.kv.block_table(request.request_id), num_tokens - len(cached_blocks) * self.config.block_size)
        request.num_computed_tokens = len(cached_blocks) * self.config.block_size
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self._remote_kv_tokens[request.request_id] = num_tokens
        return Admission.SKIPPED

    def _connector_progress(self, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Apply what the KV connector reported: loads finished (a disaggregated decode's first
        token with them), blocks sent, transfers failed. Returns the outputs this makes."""
        self.connector.update_connector_output(runner_output.kv_connector_output)
        outputs = []
        invalid = runner_output.invalid_block_ids
        for request_id in runner_output.finished_recving:
            request = self.requests.get(request_id)
            num_tokens = self._remote_kv_tokens.pop(request_id, None)
            if request is None or num_tokens is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            if invalid:  # a block failed to load: the request computes from the first such block
                table = self.kv.block_table(request_id)
                first_bad = next((i for i, block_id in enumerate(table) if block_id in invalid), None)
                if first_bad is not None:
                    num_tokens = min(num_tokens, first_bad * self.config.block_size)
            first = self.connector.take_first_token(request_id)
            if first is not None:  # sampled by the prefill instance: this request continues as a decode
                request.output_token_ids.append(first.token_id)
                request.generator_state = first.generator_state
                request.num_cached_tokens = first.num_cached_tokens
            request.num_computed_tokens = min(num_tokens, request.num_tokens - 1)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = request.num_computed_tokens
            self.kv.cache_full_blocks(request, request.num_computed_tokens)
            self.waiting.remove(request)
            status = None if first is None else check_stop(request, self.config.max_model_len)
            if status is not None:  # the first token ends it (EOS, max_tokens=1): no decode step
                self._finish(request, status)
            else:
                self._start_running(request)
            if first is not None:
                outputs.append(self.output_of(request, [first.token_id],
                                              None if first.logprobs is None else [first.logprobs]))
        for request_id in runner_output.finished_sending:
            held = self._sending.get(request_id)
            if held:
                self.kv.free_blocks(held.popleft())
                if not held:
                    del self._sending[request_id]
        for request_id, reason in self.connector.take_failed_requests().items():
            for request in self.finish_requests([request_id], RequestStatus.FINISHED_ABORTED):
                outputs.append(self.output_of(request, [])._replace(error=reason, kv_transfer_failed=True))
        return outputs

    # ----- helpers --------------------------------------------------------------------

    def _drafts_that_fit(self, request: Request, budget: int) -> list[int]:
        """The request's drafts, trimmed to the budget left beside its own token and to the
        output it may still produce (its proposer kept them under max_model_len)."""
        room = min(budget - 1, request.max_tokens - request.num_output_tokens - 1)
        drafts = request.spec_token_ids[: max(room, 0)]
        if drafts and self._has_grammar(request):
            drafts = drafts[: self.structured.num_valid_drafts(request.request_id, drafts)]
        return drafts

    def _may_run(self, request: Request) -> bool:
        """Not kept out of the steps by the failure triage."""
        return self.only is None or request.request_id in self.only

    def _schedulable(self, request: Request) -> bool:
        """May run, its grammar (if any) is ready, and (pipelined) it is not waiting for the
        token of a step in flight."""
        return (self._may_run(request) and request.request_id not in self._awaiting_token
                and self._grammar_ready(request))

    def _start_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._admission_order[request.request_id] = self._next_admission
        self._next_admission += 1

    def _schedule_running(self, request: Request, chunk: Chunk, step: StepBuilder,
                          drafts: list[int] | None = None) -> None:
        """Schedule a running request, preempting others (or, as a last resort, itself)
        until its blocks fit. Its drafts are trimmed to the blocks no other running request
        needs for its next token: drafts never cost anyone a preemption."""
        if drafts:
            held = len(self.kv.block_table(request.request_id))
            needed = self.kv.num_blocks_for(request.num_computed_tokens + chunk.num_tokens) - held
            if self.kv.num_free_blocks - len(self.running) < needed:  # (else plenty: others need a block at most)
                room = (held + self._spare_blocks(request, step)) * self.config.block_size - request.num_computed_tokens
                drafts = drafts[: max(room - 1, 0)]
                chunk = Chunk(1 + len(drafts))
        total = request.num_computed_tokens + chunk.num_tokens
        proposals = self._allocate_lookahead(request, chunk, step, drafts or [])
        while self.kv.allocate_slots(request.request_id, total) is None:
            # requests kept out of steps go first: they would not run anyway
            candidates = [r for r in self.running if not step.is_taken(r.request_id)]
            if self._in_flight:  # pipelined: a request with no step in flight loses the least, then one whose
                busy = {request_id for step in self._in_flight.values() for request_id in step}  # step samples not
                candidates = ([r for r in candidates if r.request_id not in busy]
                              or [r for r in candidates if r.request_id not in self._awaiting_token] or candidates)
            candidates = [r for r in candidates if not self._may_run(r)] or candidates
            victim = pick_victim(candidates, self.config.scheduling_policy, self._admission_order)
            self._preempt(victim, step)
            if victim is request:
                return
        self._add_to_step(request, chunk, step, drafts or [], proposals)

    def _allocate_lookahead(self, request: Request, chunk: Chunk, step: StepBuilder, drafts: list[int]) -> int:
        """With a draft model: the drafts it proposes for the request after this step, with the
        slots their rows write allocated, if they take no block another running request needs
        for its next token (else none: no drafts rather than a preemption)."""
        proposals = self._draft_model_proposals(request, chunk, step, drafts)
        if not proposals:
            return 0
        total = request.num_computed_tokens + chunk.num_tokens + proposals
        needed = self.kv.num_blocks_for(total) - len(self.kv.block_table(request.request_id))
        if self.kv.num_free_blocks - len(self.running) < needed and needed > self._spare_blocks(request, step):
            return 0
        return proposals if self.kv.allocate_slots(request.request_id, total) is not None else 0

    def _spare_blocks(self, request: Request, step: StepBuilder) -> int:
        """Free blocks that no running request but `request`, not yet in the step, needs for its next token."""
        return self.kv.num_free_blocks - sum(max(self.kv.num_blocks_for(r.num_computed_tokens + 1) - len(self.kv.block_table(r.request_id)),
                              0) for r in self.running if r is not request and not step.is_taken(r.request_id))

    def _draft_model_proposals(self, request: Request, chunk: Chunk, step: StepBuilder, drafts: list[int]) -> int:
        """With a draft model: how many drafts it should propose for the request after this step,
        if the step samples it (the slots they are computed in are allocated with the step's)."""
        if self.draft_policy is None or self.ngram is not None:
            return 0
        if request.num_computed_tokens + chunk.num_tokens - len(drafts) != request.num_tokens:
            return 0  # a prompt chunk that does not finish the prompt samples nothing
        context = request.num_tokens + len(drafts)  # (at most: the bonus token's position)
        room = min(self.config.speculative.num_speculative_tokens, self.config.max_model_len - 1 - context,
                   request.max_tokens - request.num_output_tokens - 2 - len(drafts))
        load = step.decode_load if request.is_decoding else DecodeLoad(
            step.decode_load.shape.plus(request.num_tokens, 1, is_decode=True), step.decode_load.num_decodes + 1)
        return self.draft_policy.num_drafts(request.request_id, room, load, context)

    def _add_to_step(self, request: Request, chunk: Chunk, step: StepBuilder, drafts: list[int] = (),
                     proposals: int = 0) -> None:
        request_id = request.request_id
        if request.first_scheduled_time is None:
            request.first_scheduled_time = step.now
        if not request.is_decoding:
            self.chunking.track(request_id, step.now)
            step.past_slo |= chunk.past_slo
        table = self.kv.block_table(request_id)
        sent = self._blocks_sent.get(request_id)
        self._blocks_sent[request_id] = len(table)
        step.add(request, chunk.num_tokens, table[sent or 0:], sent is None, list(drafts), proposals)
        if self.pipelined:
            request.num_computed_tokens += chunk.num_tokens
            if step.scheduled[-1].sample:
                self._awaiting_token.add(request_id)

    def _preempt(self, request: Request, step: StepBuilder) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        self._blocks_sent.pop(request.request_id, None)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        self._awaiting_token.discard(request.request_id)
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.chunking.track(request.request_id, step.now)
        self.num_preemptions += 1
        step.preempted.add(request.request_id)
        self.waiting.appendleft(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request_id = request.request_id
        request.status = status
        delay_free, _ = self.connector.request_finished(request, self.kv.block_table(request_id))
        if delay_free:  # held apart from the id, which a new request may reuse at once
            self._sending.setdefault(request_id, deque()).append(self.kv.detach(request_id))
        else:
            self.kv.remove_request(request_id)
        self._admission_order.pop(request_id, None)
        self._blocks_sent.pop(request_id, None)
        self._remote_kv_tokens.pop(request_id, None)
        self._tokens_sent.pop(request_id, None)
        self._awaiting_token.discard(request_id)
        if self.structured is not None:
            self.structured.remove(request_id)
        if self.draft_policy is not None:
            self.draft_policy.forget(request_id)
        self.chunking.forget(request_id)
        del self.requests[request_id]
        self._resend_as_new.discard(request_id)
        if request_id in self._known_to_worker:
            self._known_to_worker.discard(request_id)
            self._finished_since_last_step.add(request_id)

    # ----- structured outputs ---------------------------------------------------------------

    def _start_grammar(self, request: Request) -> None:
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        if self.structured is None:
            raise InvalidRequestError("structured outputs are not available in this engine", "structured_outputs")
        self.structured.add(request.request_id, params, request.output_token_ids)

    def _has_grammar(self, request: Request) -> bool:
        return self.structured is not None and self.structured.has(request.request_id)

    def _grammar_ready(self, request: Request) -> bool:
        return self.structured is None or self.structured.is_ready(request.request_id)

    def _fill_bitmasks(self, scheduled: list[ScheduledRequest]) -> float:
        """Each sampling row's bitmask, on its scheduled request; returns the seconds it took."""
        if self.structured is None:
            return 0.0
        start = time.perf_counter()
        for s in scheduled:
            if s.sample and self.structured.has(s.request_id):
                s.grammar_bitmask = self.structured.bitmask(s.request_id, s.draft_token_ids)
        return time.perf_counter() - start

    def _advance_grammar(self, request: Request, accepted: list[int]) -> RequestStatus | None:
        """The grammar takes the step's accepted tokens. FINISHED_ABORTED (with the reason kept
        for the output) if a token is outside it, which the bitmask should make impossible;
        FINISHED_STOPPED if it took an EOS that did not stop the request (ignore_eos): nothing
        may follow. A grammar that is complete otherwise allows only EOS next, so the request
        ends on its EOS like any other (vLLM's way), and its text is the grammar's."""
        try:
            self.structured.accept(request.request_id, accepted)
        except GrammarError as error:
            self._grammar_errors[request.request_id] = str(error)
            return RequestStatus.FINISHED_ABORTED
        if accepted[-1] == request.eos_token_id and self.structured.is_terminated(request.request_id):
            return RequestStatus.FINISHED_STOPPED
        return None

    def take_grammar_failures(self) -> list[EngineCoreOutput]:
        """Requests whose grammar did not compile: finished (aborted), with the reason."""
        if self.structured is None:
            return []
        failed = self.structured.take_failures()
        finished = self.finish_requests(failed, RequestStatus.FINISHED_ABORTED)
        return [self.output_of(r, [])._replace(error=failed[r.request_id]) for r in finished]

    @staticmethod
    def _new_request_data(request: Request) -> NewRequestData:
        return NewRequestData(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            output_token_ids=list(request.output_token_ids),
            generator_state=request.generator_state,
        )


def _connector_stats(stats: KVTierStats | KVTransferStats | None) -> dict:
    if isinstance(stats, KVTransferStats):
        return {"kv_transfer": stats}
    return {"kv_tier": stats}

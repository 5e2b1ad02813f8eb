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

This class is the loop; what a request needs beyond its counters lives with the collaborator
that uses it: what the worker has been sent (sent.py), the KV the connector loads or still
sends (remote_kv.py), draft budgets and acceptance rates (core/spec_decode/drafts.py), grammars
(grammars.py: a request waits for its grammar's compile without holding anyone up, its rows get
the grammar's bitmask, and a complete grammar finishes it), images (encoder_inputs.py: which
images a step encodes and where a chunk ends around them), the chunk policy's clock, the KV
manager's tables. Finishing a request asks each
owner to forget it; `registry_sizes()` counts every table keyed by request id, and the engine's
self-check reports any left non-empty when nothing is unfinished (a leak).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from chunkserve.config.scheduler import SchedulerConfig
from chunkserve.core.kv.events import KVEventLog
from chunkserve.core.kv.kv_cache_manager import KVCacheManager
from chunkserve.core.kv_connector import KVConnectorScheduler, NoOpConnector
from chunkserve.core.messages import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from chunkserve.core.request import Request, RequestStatus
from chunkserve.core.sched.admission import Admission, AdmissionPolicy
from chunkserve.core.sched.chunking import Chunk, ChunkPolicy
from chunkserve.core.sched.encoder_inputs import EncoderInputs, EncoderPlan
from chunkserve.core.sched.grammars import Grammars
from chunkserve.core.sched.preemption import pick_victim
from chunkserve.core.sched.remote_kv import RemoteKV
from chunkserve.core.sched.sent import SentToWorker
from chunkserve.core.sched.step_builder import StepBuilder
from chunkserve.core.spec_decode.drafts import DraftBudget
from chunkserve.core.stats import SchedulerStats
from chunkserve.core.step_predictor import StepTimePredictor
from chunkserve.core.stop import check_stop
from chunkserve.core.structured.manager import StructuredOutputManager
from chunkserve.errors import InvalidRequestError, ServerOverloadedError

NEXT_STEP_MESSAGE = "sent.finished_since_last_step"  # a registry that is the next step's message, not a leak


class Scheduler:
    def __init__(self, config: SchedulerConfig, num_blocks: int, predictor: StepTimePredictor | None = None,
                 clock: Callable[[], float] = time.time, kv_connector: KVConnectorScheduler | None = None,
                 structured: StructuredOutputManager | None = None) -> None:
        """`predictor` is the step-time model the TBT and TTFT SLOs consult (the engine feeds
        it); `clock` is the wall clock that request arrival times use; `structured` holds the
        requests' grammars (none: a request with structured_outputs is refused)."""
        self.config = config
        self.grammars = Grammars(structured)
        self.predictor = predictor
        self._clock = clock
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                 KVEventLog(config.block_size) if config.enable_kv_cache_events else None)
        self.connector = kv_connector or NoOpConnector()
        self.connector.bind_kv_cache(self.kv)
        self.encoder = EncoderInputs(config)  # images: the encoder's work per chunk, the encoder cache
        self.chunking = ChunkPolicy(config, predictor, self.encoder.embeds_to_encode)
        self.admission = AdmissionPolicy(config, predictor)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self._next_admission = 0
        self.sent = SentToWorker(config.tokens_from_steps, self.pipelined)  # the worker's view of the requests
        self.remote_kv = RemoteKV(self.connector, self.kv)  # KV the connector loads, and sends after a finish
        self.drafting = DraftBudget(config, self.kv, predictor, self.grammars)
        self._only: set[str] | None = None  # `restrict_to`
        self._ended: list[EngineCoreOutput] = []  # requests ended by `schedule` (failed grammars): outputs to come
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens of requests admitted for the first time (cumulative)
        self.prefix_cache_hits = 0  # of those, found in the prefix cache

    # ----- queue management ---------------------------------------------------------

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id!r}"
        self.encoder.check_request(request)
        self.grammars.start(request)
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
        self.encoder.check_request(request)
        num_computed = request.num_computed_tokens
        cached = self.kv.cached_run_for_import(block_hashes, has_payload, num_computed)
        num_blocks = self.kv.num_blocks_for(num_computed)
        if num_computed and len(self.running) + self.remote_kv.num_loading >= self.config.max_num_seqs:
            raise ServerOverloadedError(f"{self.config.max_num_seqs} requests are already running; retry the "
                                        "import later")
        if num_computed and self.kv.allocate_slots(request.request_id, num_computed, cached) is None:
            raise ServerOverloadedError(f"the KV pool has no room for the imported request's {num_blocks} blocks "
                                        f"({self.kv.num_free_blocks} free); retry later")
        self.grammars.start(request)
        self.requests[request.request_id] = request
        self.chunking.track(request.request_id, request.arrival_time)
        if not num_computed:  # nothing computed yet: it waits like a new request
            request.status = RequestStatus.WAITING
            self.waiting.append(request)
            return []
        self._start_running(request)
        table = self.kv.block_table(request.request_id)
        return [(table[i], i) for i in range(len(cached), num_blocks)]

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
        return bool(self.waiting or self.running or self.remote_kv.is_sending or self.connector.has_pending_work())

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
            num_cached_blocks=self.kv.pool.num_cached_blocks,
            spec_decode=None if self.drafting.policy is None else self.drafting.policy.stats(),
            **self.encoder.stats(),
            **self.remote_kv.stats(),
        )

    def check(self) -> list[str]:
        """What is inconsistent between the queues, the requests and the KV pool (for the
        engine's self-check: every block held by a live request or free)."""
        problems = self.kv.check(self.remote_kv.held_tables())
        queued = [r.request_id for r in [*self.waiting, *self.running]]
        if sorted(queued) != sorted(self.requests):
            problems.append(f"{len(self.requests)} requests known but {len(queued)} queued")
        return problems

    def leaks(self) -> list[str]:
        """The per-request registries that are not empty, for the engine's self-check to ask
        once nothing is unfinished (no request, no step in flight, no connector work): then
        each entry is a request that was never forgotten."""
        return [f"{name}: {size} left with no request unfinished"
                for name, size in self.registry_sizes().items() if size and name != NEXT_STEP_MESSAGE]

    def registry_sizes(self) -> dict[str, int]:
        """The entries of every table keyed by request id, here and in the collaborators
        (owner.name -> count). All are empty once nothing is unfinished, but
        `NEXT_STEP_MESSAGE` (the finished ids the worker hears of with the next step)."""
        owners = {"sent": self.sent, "remote_kv": self.remote_kv, "kv": self.kv, "chunking": self.chunking,
                  "drafting": self.drafting, "grammars": self.grammars, "encoder": self.encoder}
        sizes = {"requests": len(self.requests)}
        sizes.update({f"{name}.{registry}": size for name, owner in owners.items()
                      for registry, size in owner.registry_sizes().items()})
        return sizes

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix: the pool's, and what the KV connector caches (with the
        disk tier, its files of this model are removed). Refused (False) while any request is
        unfinished (a tier's writes still in flight do not count: they are removed as they land)."""
        if self.waiting or self.running or self.remote_kv.is_sending or not self.kv.reset_prefix_cache():
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
        """The next step. Requests whose grammar failed to compile end first (their outputs come with this
        step's, from `update_from_output` or `fail_requests`); a step empty while no other is in flight waits
        briefly for a grammar being compiled (the only requests that could run), so the loop does not spin."""
        self._ended += self._abort(self.grammars.take_failures())
        step = StepBuilder(self.config.max_num_batched_tokens, self._clock(), self.encoder.budget_per_step)
        if self.drafting.uses_draft_model:
            step.decode_load = self.drafting.decode_load(self.running)
        if self.config.enable_mixed_batch:
            self._schedule_decodes(step)
            self._schedule_prefills(step)
        else:
            self._schedule_prefills(step)
            if not step.scheduled:
                self._schedule_decodes(step)

        new_requests = self.sent.new_requests(step.scheduled, self.requests)
        self.prefix_cache_queries += step.prefix_cache_queries
        self.prefix_cache_hits += step.prefix_cache_hits
        mask_seconds = self.grammars.fill_bitmasks(step.scheduled)
        output = SchedulerOutput(
            scheduled=step.scheduled,
            new_requests=new_requests,
            finished_request_ids=self.sent.take_finished(),
            preempted_request_ids=step.preempted,
            prefix_cache_queries=step.prefix_cache_queries,
            prefix_cache_hits=step.prefix_cache_hits,
            predicted_duration_s=self.predictor.predict(step.shape) if self.predictor else None,
            prefill_wait_guard=step.prefill_wait_guard,
            grammar_mask_s=mask_seconds,
            free_encoder_ids=self.encoder.cache.take_evicted(),
            num_encoder_inputs=step.num_encoder_inputs,
            num_encoder_embeds=step.num_encoder_embeds,
            encoder_cache_hits=step.encoder_cache_hits,
        )
        output.kv_connector_metadata = self.connector.build_connector_meta(output)
        self.sent.step_sent(output, self.requests)
        if output.is_empty and not self._ended and not self.sent.has_steps_in_flight:
            self.grammars.wait_for_compiles()
        return output

    @property
    def pipelined(self) -> bool:
        return self.config.max_steps_in_flight > 1

    def void_step(self, output: SchedulerOutput) -> None:
        """The step failed: nothing it scheduled was computed (the counters were never
        advanced, or, pipelined, go back), and the worker may or may not have applied its
        diffs, so what it carried is sent again: new requests as new (the worker replaces a
        state it has), block tables whole, finished requests again."""
        self.sent.void(output, self.requests)
        self.encoder.void(output, self.requests)
        self.connector.step_failed(output.kv_connector_metadata)

    def update_from_output(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance the counters by what was computed and verified, append accepted tokens,
        apply the token-level stops. Returns what is new for every request that got tokens or ended."""
        outputs, self._ended = self._ended, []
        outputs += self._connector_progress(runner_output)
        continuing: list[Request] = []  # got tokens and runs on: its next drafts are proposed below
        for scheduled in output.scheduled:
            request = self.requests.get(scheduled.request_id)
            if request is None or request.is_finished:
                continue
            if self.pipelined and not self.sent.result_applies(output, request, scheduled):
                continue  # preempted (or replaced) since: void
            accepted = runner_output.sampled_token_ids.get(scheduled.request_id, [])
            rejected = len(scheduled.draft_token_ids) - (len(accepted) - 1) if accepted else 0
            assert rejected >= 0, f"{scheduled.request_id}: more tokens accepted than drafted"
            computed = scheduled.num_computed_tokens + scheduled.num_scheduled_tokens - rejected
            if not self.pipelined:  # (pipelined, it went ahead when scheduled)
                request.num_computed_tokens = computed
            request.spec_token_ids = []
            self.encoder.free_computed(request)
            if not accepted:
                self.kv.cache_full_blocks(request, computed)
                continue
            if self.drafting.policy is not None:
                self.drafting.observe(request.request_id, len(scheduled.draft_token_ids), accepted)
            status = error = None
            for count, token_id in enumerate(accepted, 1):
                request.output_token_ids.append(token_id)
                status = check_stop(request, self.config.max_model_len)
                if status is not None:
                    break
            if status is None and self.grammars.has(request.request_id):
                status, error = self.grammars.advance(request, accepted[:count])
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
            output_now = EngineCoreOutput.of(request, accepted[:count], None if logprobs is None else logprobs[:count],
                                             runner_output.prompt_logprobs.get(request.request_id))
            outputs.append(output_now if error is None else output_now._replace(error=error))
        self.sent.step_done(output)
        if self.drafting.ngram is not None and continuing:
            self.drafting.propose_ngrams(continuing, self.running)
        return outputs

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
            drafts = self.drafting.that_fit(request, step.budget - (len(decoding) - index - 1))
            self._schedule_running(request, Chunk(1 + len(drafts)), step, drafts)

    def _schedule_prefills(self, step: StepBuilder) -> None:
        """Prompts in progress, then waiting ones, in the admission policy's order."""
        in_progress = [r for r in self.running
                       if not r.is_decoding and not step.is_taken(r.request_id) and self._schedulable(r)]
        waiting = (r for r in self.waiting if r.status != RequestStatus.WAITING_FOR_REMOTE_KVS and self._may_run(r)
                   and self.grammars.is_ready(r.request_id))
        admitting = True
        prompts = [r for r in self.running if not r.is_decoding]  # what an admission is checked against
        for request in self.admission.order(in_progress, waiting, step.now):
            if step.is_taken(request.request_id):  # preempted for an earlier one: it waits
                continue
            if request.status == RequestStatus.RUNNING:
                chunk = self.chunking.chunk(request, request.num_computed_tokens, step.budget, step)
                plan = self.encoder.plan(request, request.num_computed_tokens, chunk.num_tokens, step.budget, step)
                if plan.num_tokens > 0:
                    self._schedule_running(request, Chunk(plan.num_tokens, chunk.prefill_wait_guard), step, plan=plan)
            elif admitting:
                admission = self._admit(request, step, [r for r in prompts if r.status == RequestStatus.RUNNING])
                admitting = admission != Admission.STOP
                if admission == Admission.ADMITTED:
                    prompts.append(request)

    def _admit(self, request: Request, step: StepBuilder, prompts: list[Request]) -> Admission:
        """Admit a waiting request if it fits (`prompts`: the running requests computing their prompts)."""
        if len(self.running) + self.remote_kv.num_loading >= self.config.max_num_seqs or step.budget < 1:
            return Admission.STOP  # (requests loading remote KV hold a sequence slot already)
        cached_blocks, num_cached = self.kv.get_computed_blocks(request)
        if self.kv.next_block_in_flight(request, len(cached_blocks), prompts):
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
            if not self.remote_kv.start_load(request, cached_blocks, num_cached + num_external):
                return Admission.STOP
            if request.num_preemptions == 0:
                step.count_prefix_query(request.num_tokens, num_cached)  # the pool's hit; the connector's apart
            return Admission.SKIPPED  # it runs once its KV is loaded
        start = num_cached + num_external
        chunk = self.chunking.chunk(request, start, kv_room - start, step)
        plan = self.encoder.plan(request, start, chunk.num_tokens, min(kv_room - start, step.budget), step)
        if plan.num_tokens == 0:
            return Admission.STOP  # no room in the step (or for its next image, in the encoder's budget or cache)
        chunk = Chunk(plan.num_tokens, chunk.prefill_wait_guard)
        if start + chunk.num_tokens < request.num_tokens and not self.admission.may_leave_partial(
                request, prompts, step):
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
        self.encoder.commit(request, plan, step)
        proposals = self.drafting.allocate_lookahead(request, chunk, step, [], self.running)
        self._add_to_step(request, chunk, step, (), proposals, plan.to_encode)
        return Admission.ADMITTED

    def _connector_progress(self, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Apply what the KV connector reported: loads finished (a disaggregated decode's first
        token with them), blocks sent, transfers failed. Returns the outputs this makes."""
        self.connector.update_connector_output(runner_output.kv_connector_output)
        outputs = []
        for request_id, num_tokens in self.remote_kv.finished_loads(runner_output.finished_recving,
                                                                     runner_output.invalid_block_ids):
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            first = self.connector.take_first_token(request_id)
            if first is not None:  # sampled by the prefill instance: this request continues as a decode
                first.continue_as_decode(request)
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
                outputs.append(EngineCoreOutput.of(request, [first.token_id],
                                                   None if first.logprobs is None else [first.logprobs]))
        self.remote_kv.release_sent(runner_output.finished_sending)
        for request_id, reason in self.connector.take_failed_requests().items():
            for request in self.finish_requests([request_id], RequestStatus.FINISHED_ABORTED):
                outputs.append(EngineCoreOutput.of(request, [])._replace(error=reason, kv_transfer_failed=True))
        return outputs

    # ----- helpers --------------------------------------------------------------------

    def _may_run(self, request: Request) -> bool:
        """Not kept out of the steps by the failure triage."""
        return self._only is None or request.request_id in self._only

    def _schedulable(self, request: Request) -> bool:
        """May run, its grammar (if any) is ready, and (pipelined) it is not waiting for the
        token of a step in flight."""
        return (self._may_run(request) and not self.sent.is_awaiting_token(request.request_id)
                and self.grammars.is_ready(request.request_id))

    def _start_running(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        request.admission_seq = self._next_admission
        self._next_admission += 1

    def _schedule_running(self, request: Request, chunk: Chunk, step: StepBuilder,
                          drafts: list[int] | None = None, plan: EncoderPlan | None = None) -> None:
        """Schedule a running request, preempting others (or, as a last resort, itself)
        until its blocks fit. Its drafts are trimmed to the blocks no other running request
        needs for its next token: drafts never cost anyone a preemption."""
        if drafts:
            chunk, drafts = self.drafting.trim_to_blocks(request, chunk, step, drafts, self.running)
        total = request.num_computed_tokens + chunk.num_tokens
        proposals = self.drafting.allocate_lookahead(request, chunk, step, drafts or [], self.running)
        while self.kv.allocate_slots(request.request_id, total) is None:
            # requests kept out of steps go first: they would not run anyway; pipelined, a request with no
            # step in flight loses the least, then one whose step samples not
            candidates = self.sent.prefer_idle([r for r in self.running if not step.is_taken(r.request_id)])
            candidates = [r for r in candidates if not self._may_run(r)] or candidates
            victim = pick_victim(candidates, self.config.scheduling_policy)
            self._preempt(victim, step)
            if victim is request:
                return
        if plan is not None:
            self.encoder.commit(request, plan, step)
        self._add_to_step(request, chunk, step, drafts or [], proposals, plan.to_encode if plan else [])

    def _add_to_step(self, request: Request, chunk: Chunk, step: StepBuilder, drafts: list[int] = (),
                     proposals: int = 0, encoder_inputs: list[int] = ()) -> None:
        request_id = request.request_id
        if request.first_scheduled_time is None:
            request.first_scheduled_time = step.now
        if not request.is_decoding:
            self.chunking.track(request_id, step.now)
            step.prefill_wait_guard |= chunk.prefill_wait_guard
        new_block_ids, resets_block_table = self.sent.block_diff(request_id, self.kv.block_table(request_id))
        step.add(request, chunk.num_tokens, new_block_ids, resets_block_table, list(drafts), proposals, encoder_inputs)
        if self.pipelined:
            request.num_computed_tokens += chunk.num_tokens
            if step.scheduled[-1].sample:
                self.sent.await_token(request_id)

    def _preempt(self, request: Request, step: StepBuilder) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        self.encoder.forget(request)
        self.sent.preempted(request.request_id)
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        request.status = RequestStatus.PREEMPTED
        self.chunking.track(request.request_id, step.now)
        self.num_preemptions += 1
        step.preempted.add(request.request_id)
        self.waiting.appendleft(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """The request leaves: each owner of its state forgets it (its blocks are freed, or
        held while the KV connector sends them)."""
        request_id = request.request_id
        request.status = status
        self.remote_kv.forget(request)
        self.sent.forget(request_id)
        self.drafting.forget(request_id)
        self.chunking.forget(request_id)
        self.grammars.forget(request_id)
        self.encoder.forget(request)
        del self.requests[request_id]

    def restrict_to(self, request_ids: set[str] | None) -> None:
        """While the engine searches for the request that makes steps fail, only these run (the others keep
        their blocks and wait); None: every request may run."""
        self._only = request_ids

    def fail_requests(self, reasons: dict[str, str]) -> list[EngineCoreOutput]:
        """A void step's end: abort the requests found to fail it, with their reasons. Returns their outputs,
        after those of the requests `schedule` ended (which `update_from_output` would have returned)."""
        outputs, self._ended = self._ended, []
        return outputs + self._abort(reasons)

    def _abort(self, reasons: dict[str, str]) -> list[EngineCoreOutput]:
        return [EngineCoreOutput.of(r, [])._replace(error=reasons[r.request_id])
                for r in self.finish_requests(reasons, RequestStatus.FINISHED_ABORTED)]


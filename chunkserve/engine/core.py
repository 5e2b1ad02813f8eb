"""The engine core: token ids in, new token ids out. One `step()` is

    scheduler.schedule() -> executor.execute_model() -> scheduler.update_from_output()

and everything textual (tokenizing, detokenizing, stop strings) happens in the frontend
(input_processor.py, output_processor.py). The core also times its steps, feeds the
step-time model the TBT/TTFT SLOs plan with, and keeps a record of every step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import zlib
from collections import deque
from collections.abc import Sequence

from chunkserve.config.engine import EngineArgs
from chunkserve.config.model import resolve_model
from chunkserve.core.clock import SYSTEM_CLOCK, Clock
from chunkserve.core.kv.events import MEDIUM_POOL, external_block_hash
from chunkserve.core.kv.layout import ModelFingerprint
from chunkserve.core.kv.snapshot import RequestSnapshot, SnapshotBlock
from chunkserve.core.kv_connector import KVConnectorScheduler
from chunkserve.core.kv_connector_factory import build_scheduler_side
from chunkserve.core.messages import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from chunkserve.core.request import Request, RequestStatus
from chunkserve.core.sched.scheduler import Scheduler
from chunkserve.core.stats import SchedulerStats, hit_rate
from chunkserve.core.step_predictor import StepShape, StepTimePredictor, observed_step_seconds
from chunkserve.core.structured.manager import StructuredOutputManager
from chunkserve.engine.frontend import multimodal_processor
from chunkserve.engine.kv_events import KVEventPublisher
from chunkserve.engine.messages import EngineCoreOutputs, EngineCoreRequest, EngineInfo
from chunkserve.engine.outputs import StepRecord
from chunkserve.engine.triage import StepFailureTriage
from chunkserve.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from chunkserve.executor.base import Executor, StepHandle
from chunkserve.executor.uniproc import UniProcExecutor
from chunkserve.model.config import ModelConfig

logger = logging.getLogger(__name__)

MAX_STEP_RECORDS = 100_000
# at shutdown, the longest the KV connector's pending writes are waited for: within the 30 s the server's
# frontend gives the engine process to exit (AsyncLLM.shutdown)
KV_SETTLE_TIMEOUT_S = 20.0
EXPORT_MODES = ("copy", "pause")
# For tests only: every step that runs requests takes at least this much longer, so a test can act
# while a request is still prefilling or decoding on a model whose steps take a millisecond.
TEST_STEP_DELAY_ENV = "CHUNKSERVE_TEST_STEP_DELAY_MS"


@dataclasses.dataclass(frozen=True, slots=True)
class StepTiming:
    """When a step started (wall clock for its record, perf_counter for its duration) and the
    SLO margin it was planned with."""

    start_wall: float
    start: float
    margin: float

    @classmethod
    def start_now(cls, predictor: StepTimePredictor, clock: Clock) -> StepTiming:
        return cls(clock.time(), clock.perf_counter(), predictor.margin)


class EngineCore:
    def __init__(self, config: EngineArgs, executor: Executor | None = None,
                 kv_connector: KVConnectorScheduler | None = None, clock: Clock = SYSTEM_CLOCK) -> None:
        """`kv_connector`: the scheduler's side of a KV connector (its worker side goes to the
        executor's workers); none: the connector the flags configure, if any (the disk tier or a
        side of disaggregation, from core/kv_connector_factory.py's table; the workers build its
        worker side from the same row). `clock`: what every time stamp and step duration reads
        (a simulation's virtual clock, core/clock.py)."""
        self.config = config
        self.clock = clock
        self.executor = executor or make_executor(config)
        self.kv_events: KVEventPublisher | None = None
        try:
            self._start(config, kv_connector)
        except BaseException:  # the executor's worker processes must not outlive a core that never started
            self._close_kv_events()
            self.executor.shutdown()
            raise

    def _start(self, config: EngineArgs, kv_connector: KVConnectorScheduler | None) -> None:
        self.model_config: ModelConfig = self.executor.model_config
        num_blocks = self.executor.determine_num_kv_blocks()
        self.max_model_len = resolve_max_model_len(config, self.model_config, num_blocks)
        self.engine_config = config.create_engine_config(self.max_model_len, self._max_tokens_per_image())
        self.scheduler_config = self.engine_config.scheduler
        self.executor.load_model(self.max_model_len)
        self.executor.initialize_kv_cache(num_blocks)
        self.predictor = StepTimePredictor()
        self._fingerprint: ModelFingerprint | None = None
        if kv_connector is None:  # the connector the flags ask for (the workers build its other side)
            kv_connector = build_scheduler_side(self.engine_config.kv_connector, lambda: self.fingerprint)
        self.structured = StructuredOutputManager(self._load_tokenizer, self.model_config.vocab_size)
        self.scheduler = Scheduler(self.scheduler_config, num_blocks, self.predictor, clock=self.clock.time,
                                   kv_connector=kv_connector, structured=self.structured)
        kv_events = self.engine_config.kv_events
        self.kv_events = KVEventPublisher(kv_events) if kv_events is not None and kv_events.publishes else None
        self._publish_kv_events()  # (the disk tier's files found at start)
        self.triage = StepFailureTriage()
        self._test_step_delay_s = float(os.environ.get(TEST_STEP_DELAY_ENV, "0") or 0) / 1000
        self.step_records: deque[StepRecord] = deque(maxlen=MAX_STEP_RECORDS)
        self._next_step_id = 0
        self._kv_transfer_bytes = 0  # the connector's running total at the last record
        # pipelined: steps handed to the executor whose outputs are not back, oldest first
        self._in_flight: deque[tuple[SchedulerOutput, StepHandle, StepTiming]] = deque()
        speculative = self.scheduler_config.speculative
        if (self.scheduler_config.tbt_slo_ms is not None or self.scheduler_config.ttft_slo_ms is not None
                or (speculative is not None and speculative.policy == "auto")):  # (these plan with the model)
            self._profile_step_time()
        logger.info("engine core ready: %s in %s, %d KV blocks of %d tokens, max_model_len %d",
                    self.model_config.architecture, config.dtype, num_blocks, config.block_size, self.max_model_len)

    def _load_tokenizer(self):
        """The model's tokenizer, for the grammars (loaded by the first one, on its compile thread)."""
        from chunkserve.engine.tokenizer import load_tokenizer

        return load_tokenizer(resolve_model(self.config.model), self.config.tokenizer)

    def info(self, model_name: str) -> EngineInfo:
        return EngineInfo(model_name, self.max_model_len, self.model_config.vocab_size, self.executor.cpu_threads(),
                          self.scheduler_config.max_num_batched_tokens)

    def _max_tokens_per_image(self) -> int | None:
        """The most placeholder tokens one image may take (the scheduler's encoder budgets and
        --disable-chunked-mm-input's start-up check); None for a text-only model."""
        if self.model_config.multimodal is None:
            return None
        return multimodal_processor(resolve_model(self.config.model)).max_tokens_per_item()

    # ----- requests ---------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        room = None if request.kv_transfer_params is None else request.kv_transfer_params.room
        if room is not None and any(r.kv_transfer_params is not None and r.kv_transfer_params.room == room
                                    for r in self.scheduler.requests.values()):
            raise InvalidRequestError(f"bootstrap_room {room} is already in use by a request in flight",
                                      "bootstrap_room")
        self.scheduler.add_request(Request(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            priority=request.priority,
            arrival_time=request.arrival_time,
            cache_salt=request.cache_salt,
            kv_transfer_params=request.kv_transfer_params,
            mm_features=request.mm_features,
        ))

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """Abort requests at any point; their blocks return to the pool at once."""
        aborted = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        if self.triage.is_active:
            self.triage.forget(request_ids)
            self._restrict_to_tested()
        return [EngineCoreOutput.of(request, []) for request in aborted]

    # ----- snapshots: a request and its KV, out of this engine and into another ---------------

    @property
    def fingerprint(self) -> ModelFingerprint:
        """The KV this engine writes (computed on first use: it hashes the weights)."""
        if self._fingerprint is None:
            self._fingerprint = self.executor.collective_rpc("kv_fingerprint")[0]
        return self._fingerprint

    def export_request(self, request_id: str, mode: str = "copy",
                       skip_block_hashes: frozenset[bytes] = frozenset()) -> RequestSnapshot:
        """The request's snapshot as of the last step. `copy` leaves it running here; `pause`
        hands it over: it leaves this engine (its blocks return to the pool, cached ones stay
        findable) without an output. Blocks named in `skip_block_hashes` (the destination caches
        them) travel without their payload."""
        if mode not in EXPORT_MODES:
            raise InvalidRequestError(f"export mode must be one of {EXPORT_MODES}, got {mode!r}")
        self._refuse_snapshots_when_split()
        request = self.scheduler.requests.get(request_id)
        if request is None:
            raise InvalidRequestError(f"no unfinished request {request_id!r} to export")
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            raise InvalidRequestError(f"request {request_id!r} is still loading its KV; export it later")
        if request.mm_features:  # a snapshot carries token ids only: its blocks' image keys could not be checked
            raise InvalidRequestError(f"request {request_id!r} has images, and requests with images cannot be "
                                      "exported: a snapshot carries no images")
        block_size = self.config.block_size
        num_computed = request.num_computed_tokens
        hashes = self.scheduler.kv.block_hashes_for(request, num_computed // block_size)
        table = self.scheduler.kv.block_table(request_id)[: self.scheduler.kv.num_blocks_for(num_computed)]
        wanted = [i for i in range(len(table)) if i >= len(hashes) or hashes[i] not in skip_block_hashes]
        payloads = dict(zip(wanted, self.executor.collective_rpc("read_kv_blocks", ([table[i] for i in wanted],))[0]))
        blocks = [SnapshotBlock(hashes[i] if i < len(hashes) else None,
                                zlib.crc32(payloads[i]) if i in payloads else 0, payloads.get(i))
                  for i in range(len(table))]
        generator_state = request.generator_state  # the imported one, until the worker has it
        if self.scheduler.sent.has_state(request_id):
            generator_state = self.executor.collective_rpc("generator_state", (request_id,))[0]
        snapshot = RequestSnapshot(
            fingerprint=self.fingerprint, request_id=request_id,
            prompt_token_ids=list(request.prompt_token_ids), output_token_ids=list(request.output_token_ids),
            num_computed_tokens=num_computed, sampling_params=request.sampling_params,
            generator_state=generator_state, eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time, priority=request.priority, cache_salt=request.cache_salt,
            num_cached_tokens=request.num_cached_tokens or 0, num_preemptions=request.num_preemptions,
            first_scheduled_time=request.first_scheduled_time, blocks=blocks,
        )
        if mode == "pause":
            self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
            if self.triage.is_active:
                self.triage.forget([request_id])
                self._restrict_to_tested()
        return snapshot

    def import_request(self, snapshot: RequestSnapshot, request_id: str | None = None) -> None:
        """Continue a request exported by an engine of the same model (under `request_id`, or
        its own id): its KV is copied into this pool, skipping the blocks this pool caches, and
        it runs from where it stopped. A snapshot that does not fit this engine is refused with
        InvalidRequestError before anything is allocated."""
        self._refuse_snapshots_when_split()
        snapshot.verify(self.fingerprint)
        params = snapshot.sampling_params
        if params.max_tokens is None or len(snapshot.output_token_ids) >= params.max_tokens:
            raise InvalidRequestError("the imported request has no tokens left to generate (max_tokens)")
        longest = len(snapshot.prompt_token_ids) + params.max_tokens
        if longest > self.max_model_len:
            raise InvalidRequestError(f"the imported request may reach {longest} tokens (prompt + max_tokens), more "
                                      f"than this engine's max_model_len ({self.max_model_len})")
        request = Request(
            request_id=request_id or snapshot.request_id, prompt_token_ids=list(snapshot.prompt_token_ids),
            sampling_params=params, eos_token_id=snapshot.eos_token_id, arrival_time=snapshot.arrival_time,
            priority=snapshot.priority, cache_salt=snapshot.cache_salt,
            output_token_ids=list(snapshot.output_token_ids), num_computed_tokens=snapshot.num_computed_tokens,
            num_preemptions=snapshot.num_preemptions, num_cached_tokens=snapshot.num_cached_tokens,
            first_scheduled_time=snapshot.first_scheduled_time, generator_state=snapshot.generator_state,
        )
        num_full = snapshot.num_computed_tokens // self.config.block_size
        fills = self.scheduler.import_request(request, [b.block_hash for b in snapshot.blocks[:num_full]],
                                              [b.payload is not None for b in snapshot.blocks])
        try:
            if fills:
                self.flush_kv_connector()  # blocks the allocation evicted are saved before they are overwritten
                self.executor.collective_rpc("write_kv_blocks", ([block_id for block_id, _ in fills],
                                                                 [snapshot.blocks[i].payload for _, i in fills]))
            self.scheduler.kv.cache_full_blocks(request, request.num_computed_tokens)
        except BaseException:  # its blocks were never filled: they must not stay, let alone be cached
            self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)
            raise
        finally:
            self._publish_kv_events()

    def _refuse_snapshots_when_split(self) -> None:
        if self.config.parallel_config().world_size > 1:
            raise InvalidRequestError("request snapshots (export/import) are not supported with tensor or pipeline "
                                      "parallelism yet: each rank holds only its share of the KV")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.scheduler.requests)

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix: the pool's and, with the disk KV tier
        (`enable_hierarchical_cache`), the tier's too: its files of this model are removed.
        Refused (False) while any request is unfinished."""
        reset = self.scheduler.reset_prefix_cache()
        self._publish_kv_events()
        return reset

    def check(self) -> dict:
        """The engine's self-check: `ok` when its state is consistent and it is idle, with
        every KV block free or cached and no request left; once nothing is unfinished, a
        per-request registry of the scheduler's that still holds entries is a problem (a leak)."""
        problems = self.scheduler.check()
        if not self.has_unfinished_requests():
            problems += self.scheduler.leaks()
        pool = self.scheduler.kv.pool
        report = {"num_requests": len(self.scheduler.requests), "num_free_blocks": pool.num_free_blocks,
                  "num_cached_blocks": pool.num_cached_blocks, "num_blocks": pool.num_blocks}
        idle = report["num_requests"] == 0 and pool.num_free_blocks == pool.num_blocks
        return {"ok": not problems and idle, "problems": problems, **report}

    def cached_blocks(self) -> dict:
        """Every block the caches hold now, by medium, named as KV events name them: what a
        router's index of this engine's events must equal once the engine is quiet."""
        blocks = {MEDIUM_POOL: [h for h, _ in self.scheduler.kv.pool.cached_blocks()],
                  **self.scheduler.connector.stored_block_hashes()}
        return {"block_size": self.config.block_size,
                "blocks": {medium: [external_block_hash(h) for h in hashes] for medium, hashes in blocks.items()}}

    # ----- the step -----------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs | None:
        """One step; None when nothing was scheduled (unless the KV connector reported progress:
        then no outputs and no record, but fresh stats). A step the executor fails is void and
        fails only the requests found to cause it (triage.py); the others run again. Requests the
        scheduler ended before the step (grammars that failed to compile) come with its outputs.
        What the step changed in the prefix cache is published after it (KV events)."""
        outputs = self._step()
        self._publish_kv_events()
        return outputs

    def _publish_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.publish(self.scheduler.kv.events.take())

    def _step(self) -> EngineCoreOutputs | None:
        if self.scheduler_config.max_steps_in_flight > 1:
            return self._step_pipelined()
        timing = StepTiming.start_now(self.predictor, self.clock)
        scheduled = self.scheduler.schedule()
        self._delay_for_tests(scheduled)
        try:
            runner_output = self.executor.execute_model(scheduled)
        except EngineDeadError:
            raise
        except Exception as error:
            return self._void_step(scheduled, error)
        return self._complete_step(scheduled, runner_output, timing)

    def _delay_for_tests(self, scheduled: SchedulerOutput) -> None:
        """CHUNKSERVE_TEST_STEP_DELAY_MS: tests make a request outlast their action by construction."""
        if self._test_step_delay_s and not scheduled.is_empty:
            time.sleep(self._test_step_delay_s)

    def _step_pipelined(self) -> EngineCoreOutputs | None:
        """Pipeline parallelism: keep up to `max_steps_in_flight` steps in flight (each stage
        works on a different one), then take the oldest one's output. A step that fails voids
        every step in flight after it too (they were scheduled on its progress)."""
        while len(self._in_flight) < self.scheduler_config.max_steps_in_flight:
            timing = StepTiming.start_now(self.predictor, self.clock)
            scheduled = self.scheduler.schedule()
            if scheduled.is_empty and self._in_flight:  # all that may run is in flight: its finished ids ride
                self.scheduler.void_step(scheduled)  # the next step
                break
            self._delay_for_tests(scheduled)
            self._in_flight.append((scheduled, self.executor.submit(scheduled), timing))
            if scheduled.is_empty:  # nothing in flight, nothing to run: it carries finished ids alone
                break
        scheduled, handle, timing = self._in_flight.popleft()
        try:
            runner_output = handle.result()
        except EngineDeadError:
            raise
        except Exception as error:
            return self._void_step(scheduled, error, self._take_in_flight())
        return self._complete_step(scheduled, runner_output, timing)

    def _take_in_flight(self) -> list[SchedulerOutput]:
        """The steps in flight behind a failed one, once their outputs (or failures) are back: they
        were scheduled on its progress, so they are void too."""
        later = []
        while self._in_flight:
            step, pending, _ = self._in_flight.popleft()
            try:
                pending.result()
            except EngineDeadError:
                raise
            except Exception:
                pass
            later.append(step)
        return later

    def _complete_step(self, scheduled: SchedulerOutput, runner_output: ModelRunnerOutput,
                       timing: StepTiming) -> EngineCoreOutputs | None:
        prompt_chunks = self._prompt_chunks(scheduled)  # (before the step's finished requests are forgotten)
        outputs = self.scheduler.update_from_output(scheduled, runner_output)  # an empty step may report KV progress
        if self.triage.is_active:
            if scheduled.is_empty:  # none of the tested can run now (short of KV, say): search no more
                self.triage.end()
            self.triage.on_success([s.request_id for s in scheduled.scheduled])
            self.triage.forget([o.request_id for o in outputs if o.finished])
            self._restrict_to_tested()
        if scheduled.is_empty:  # (a KV connector's progress shows in the stats, e.g. /metrics)
            if runner_output.kv_connector_output is None and not outputs and not runner_output.finished_sending:
                return None  # (a transfer that timed out has an output; held blocks freed change the stats)
            return EngineCoreOutputs(outputs, self.clock.time(), None, self.scheduler.stats())
        duration = self.clock.since(timing.start)
        # (pipelined, a step's wall time includes waiting behind the steps before it)
        shape = StepShape.of(scheduled.scheduled, scheduled.num_encoder_embeds)
        self.predictor.observe(shape, observed_step_seconds(
            runner_output.rank_stats, self.scheduler_config.max_steps_in_flight, duration))
        stats = self.scheduler.stats()
        record = self._record(scheduled, timing, duration, stats, runner_output, shape, prompt_chunks)
        return EngineCoreOutputs(outputs, self.clock.time(), record, stats)

    def _void_step(self, scheduled: SchedulerOutput, error: Exception,
                   later: Sequence[SchedulerOutput] = ()) -> EngineCoreOutputs | None:
        """The step (and, pipelined, the `later` ones in flight behind it) failed: void them, fail
        the requests that caused it (or, unknown, start or narrow the triage's search)."""
        for step in [*reversed(later), scheduled]:
            self.scheduler.void_step(step)
        requests = self.scheduler.requests
        in_step = sorted((requests[s.request_id] for s in scheduled.scheduled if s.request_id in requests),
                         key=lambda r: (r.arrival_time, r.request_id))
        culprits = error.request_ids if isinstance(error, RequestFailedError) else []
        culprits = [i for i in culprits if i in requests]
        if culprits:
            logger.warning("engine step failed because of request(s) %s: %s; failing them alone", culprits, error)
            reason = str(error)
        else:
            logger.error("engine step of %d request(s) failed; finding the cause", len(in_step), exc_info=error)
            culprits = self.triage.on_failure([r.request_id for r in in_step])
            reason = f"the engine step failed ({error!r}) whenever this request was in it"
        outputs = self.scheduler.fail_requests(dict.fromkeys(culprits, reason))
        if self.triage.is_active:
            self.triage.forget(culprits)
        self._restrict_to_tested()
        if not outputs:
            return None
        return EngineCoreOutputs(outputs, self.clock.time(), None, self.scheduler.stats())

    def _restrict_to_tested(self) -> None:
        """While the triage searches, only the requests it tests run."""
        self.scheduler.restrict_to(self.triage.tested)

    def _prompt_chunks(self, scheduled: SchedulerOutput) -> tuple[tuple[str, int, int, int], ...]:
        """(request id, first position, tokens, prompt length) of each row computing a prompt."""
        requests = self.scheduler.requests
        return tuple((s.request_id, s.num_computed_tokens, s.num_scheduled_tokens,
                      requests[s.request_id].num_prompt_tokens)
                     for s in scheduled.scheduled if not s.is_decode and s.request_id in requests)

    def _record(self, scheduled: SchedulerOutput, timing: StepTiming, duration: float, stats: SchedulerStats,
                runner_output: ModelRunnerOutput, shape: StepShape,
                prompt_chunks: tuple[tuple[str, int, int, int], ...]) -> StepRecord:
        errors = self.predictor.error_quantiles()
        pipelined = self.scheduler_config.max_steps_in_flight > 1
        moved = 0
        if stats.kv_transfer is not None:  # bytes sent or copied in since the last record (empty steps have none)
            moved = stats.kv_transfer.bytes_total - self._kv_transfer_bytes
            self._kv_transfer_bytes = stats.kv_transfer.bytes_total
        record = StepRecord(
            step_id=self._next_step_id,
            start_time=timing.start_wall,
            duration_s=duration,
            predicted_duration_s=scheduled.predicted_duration_s,
            prediction_error_p50=errors[0] if errors else None,
            prediction_error_p90=errors[1] if errors else None,
            slo_margin=timing.margin,
            prefill_wait_guard=scheduled.prefill_wait_guard,
            forward_mode=scheduled.forward_mode,
            num_prefill_tokens=scheduled.num_prefill_tokens,
            num_decode_tokens=scheduled.num_decode_tokens,
            num_requests=len(scheduled.scheduled),
            num_preemptions=len(scheduled.preempted_request_ids),
            kv_cache_usage=self.scheduler.kv.usage,
            prefix_cache_queries=scheduled.prefix_cache_queries,
            prefix_cache_hits=scheduled.prefix_cache_hits,
            prefix_cache_hit_rate=hit_rate(self.scheduler.prefix_cache_hits, self.scheduler.prefix_cache_queries),
            kv_transfer_bytes=moved,
            num_draft_tokens=sum(len(s.draft_token_ids) for s in scheduled.scheduled),
            num_accepted_tokens=sum(len(runner_output.sampled_token_ids.get(s.request_id, ())) - 1
                                    for s in scheduled.scheduled if s.draft_token_ids),
            grammar_mask_s=scheduled.grammar_mask_s,
            grammar_compile_s=tuple(self.structured.take_compile_seconds()),
            num_encoder_inputs=scheduled.num_encoder_inputs,
            num_encoder_embeds=scheduled.num_encoder_embeds,
            encoder_cache_hits=scheduled.encoder_cache_hits,
            encoder_s=runner_output.encoder_seconds,
            request_ids=tuple(s.request_id for s in scheduled.scheduled) if pipelined else (),
            sampled_request_ids=tuple(s.request_id for s in scheduled.scheduled if s.sample) if pipelined else (),
            ranks=tuple(dataclasses.asdict(r) for r in runner_output.rank_stats) if len(runner_output.rank_stats) > 1
            else (),
            deterministic=self.config.deterministic,
            shape=shape.counts,
            prompt_chunks=prompt_chunks,
        )
        self.step_records.append(record)
        self._next_step_id += 1
        return record

    # ----- the step-time profile -------------------------------------------------------------

    def time_synthetic_step(self, rows: list[tuple[int, int]], seed: int = 0) -> float:
        """Run one step of made-up requests, a (start position, tokens) pair each, and return
        its seconds. For the start-up profile and benchmarks/engine/step_time_curve.py: only while no
        request is unfinished, as its KV lands in blocks 0.. (the pool's prefix cache is dropped;
        a disk KV tier keeps its files, and with write_back the pool's blocks are not saved)."""
        if self.has_unfinished_requests() or not self.scheduler.kv.reset_prefix_cache():
            raise RuntimeError("time_synthetic_step needs an idle engine: its KV overwrites pool blocks")
        for start, num_tokens in rows:
            if start + num_tokens > self.max_model_len:
                raise InvalidRequestError(f"synthetic request ({start}, {num_tokens}) exceeds max_model_len")
        return self.executor.profile(rows, seed)

    def _profile_step_time(self) -> None:
        """Seed the step-time model with a few synthetic steps (a few seconds at most), so the
        SLOs have predictions from the first real step: chunks of 16 tokens and a quarter, half
        and all of the budget (capped at 512: the model extrapolates linearly), one after a
        long context, decode batches of 1, 8 and 32 rows, and a mix."""
        config = self.scheduler_config
        chunk = min(config.max_num_batched_tokens, 512, self.max_model_len // 2)
        decode_context = min(256, self.max_model_len - 1)
        decodes = [[(decode_context, 1)] * n for n in (1, 8, 32) if n <= config.max_num_seqs]
        steps = [[(0, min(16, chunk))], [(0, max(chunk // 4, 1))], [(0, max(chunk // 2, 1))], [(0, chunk)],
                 [(chunk, chunk)], *decodes, decodes[-1][:8] + [(0, max(chunk // 2, 1))]]
        self.time_synthetic_step(steps[0])  # warm-up
        for index, step in enumerate(steps):
            self.predictor.observe(StepShape.of_rows(step), self.time_synthetic_step(step, seed=index),
                                   count_error=False)
        self.predictor.refit()
        logger.info("step-time model from %d profile steps: %s", len(steps), self.predictor.describe())

    def flush_kv_connector(self) -> None:
        """Run one step that computes nothing but hands the KV connector's pending saves to the
        worker (which copies them out of the pool at once), if it has any. A pool write outside
        the steps (`write_kv_blocks`) must come after it: between taking the blocks (an
        allocation that may evict cached ones, which write_back saves) and writing them, and
        before registering the written blocks in the prefix cache (which write_through saves),
        else the tier could copy out a block already overwritten, or not yet written."""
        if self.scheduler.connector.has_pending_work():
            output = self.scheduler.schedule_connector_only()
            self.scheduler.update_from_output(output, self.executor.execute_model(output))

    def shutdown(self) -> None:
        """Stop the executor. With the disk KV tier, settle it first: write_back saves every block
        the pool caches that the tier lacks, and every pending write lands (at most
        KV_SETTLE_TIMEOUT_S), so a restart on the same folder finds them."""
        self.structured.shutdown()
        connector = self.scheduler.connector
        connector.begin_shutdown()
        deadline = time.monotonic() + KV_SETTLE_TIMEOUT_S
        try:
            while connector.has_pending_work():
                if time.monotonic() > deadline:
                    logger.warning("the KV connector is still busy after %.0f s; shutting down without it",
                                   KV_SETTLE_TIMEOUT_S)
                    break
                self.flush_kv_connector()
        except Exception:
            logger.exception("settling the KV connector at shutdown failed")
        self._publish_kv_events()
        self._close_kv_events()
        self.executor.shutdown()

    def _close_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None


def make_executor(config: EngineArgs) -> Executor:
    """The executor `distributed_executor_backend` names: the model in this process, or one
    worker process per rank."""
    if config.executor_backend == "mp":
        from chunkserve.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config)
    return UniProcExecutor(config)


def resolve_max_model_len(config: EngineArgs, model_config: ModelConfig, num_blocks: int) -> int:
    pool_tokens = num_blocks * config.block_size
    model_limit = model_config.max_position_embeddings
    if model_config.sliding_window:
        model_limit = min(model_limit, model_config.sliding_window)
    requested = config.max_model_len
    if requested is None:
        if pool_tokens < model_limit:
            logger.warning("max_model_len capped at %d tokens: all the KV pool holds", pool_tokens)
        return min(model_limit, pool_tokens)
    if requested > model_limit:
        raise InvalidRequestError(f"max_model_len {requested} exceeds the model's limit of {model_limit} tokens")
    if requested > pool_tokens:
        raise InvalidRequestError(
            f"max_model_len {requested} exceeds what the KV pool holds ({num_blocks} blocks x "
            f"{config.block_size} = {pool_tokens} tokens): raise kv_cache_memory_gb (or kv_cache_memory_bytes) "
            "or num_kv_blocks"
        )
    return requested



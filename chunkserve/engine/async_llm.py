"""The engine behind the server: asyncio callers add, stream and abort requests; the engine
core (`chunkserve.engine.core`) runs them, and callers never wait on a step.

The core runs either in a process of its own (`from_engine_args`, what `chunkserve serve`
uses) or on a thread of this process (`from_engine`, over an engine the caller keeps: tests
and `--disable-frontend-multiprocessing`). Either way it is driven by the same commands and
reports the same events (engine/messages.py). Text stays on this side: the input processor
tokenizes and checks each request before the core sees it, and the output processor turns the
core's new token ids into each request's `RequestOutput` (one per step that gave it tokens,
the moment the step ends), settling the futures of adds and prefix cache resets, keeping the
step records and calling the step observers (/metrics, the trace).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from chunkserve.config.engine import EngineArgs
from chunkserve.config.model import ModelSource, resolve_model
from chunkserve.core.disagg.protocol import TransferParams
from chunkserve.core.kv.snapshot import RequestSnapshot
from chunkserve.core.stats import SchedulerStats
from chunkserve.engine.core import MAX_STEP_RECORDS
from chunkserve.engine.core_client import CoreClient, EventHandler, ProcessCore, ThreadCore
from chunkserve.engine.core_process import EngineProcess
from chunkserve.engine.frontend import Frontend
from chunkserve.engine.input_processor import MultiModalPrompt, Prompt
from chunkserve.engine.llm_engine import LLMEngine
from chunkserve.engine.messages import (
    AbortRequests,
    Accepted,
    AddRequest,
    CallCore,
    CoreCallResult,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDied,
    Event,
    ExportRequest,
    ImportRequest,
    Shutdown,
    Stopped,
    imported_core_request,
)
from chunkserve.engine.output_processor import OutputProcessor
from chunkserve.engine.outputs import RequestOutput, StepRecord
from chunkserve.engine.tokenizer import load_tokenizer
from chunkserve.errors import EngineDeadError, InvalidRequestError, RequestAbortedError
from chunkserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MAX_UNREAD_OUTPUTS = 1024

# Called after every step or batch of aborts: the step's record (None when no step ran), the
# outputs it produced, and the scheduler's state after it. It runs on the thread that receives
# the core's events (the engine thread itself when the core runs on a thread).
StepObserver = Callable[[StepRecord | None, list[RequestOutput], SchedulerStats], None]


def client_request_id(core_id: str) -> str:
    """The caller's id of a request the core knows as `core_id` (the caller's id, '#', a serial
    number: callers may reuse an id, the core may not)."""
    return core_id.rsplit("#", 1)[0]


class RequestStream:
    """One accepted request's outputs: one after every step that gave it a token, the last
    with `finished` set. Leaving the iteration early, or `abort()`, aborts the request."""

    def __init__(self, request_id: str, outputs: asyncio.Queue, abort: Callable[[], None]) -> None:
        self.request_id = request_id
        self.finished = False
        self._outputs = outputs
        self._abort = abort  # aborts this request in the core (never a later one reusing its id)

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                output = await self._outputs.get()
                if isinstance(output, BaseException):
                    self.finished = True
                    raise output
                self.finished = output.finished
                yield output
        finally:
            self.abort()

    def abort(self) -> None:
        """Abort unless already finished; safe to call any number of times."""
        if not self.finished:
            self.finished = True
            self._abort()


class AsyncLLM:
    """`await`-able generation over an engine core; build it with `from_engine_args` or
    `from_engine`."""

    def __init__(self, start_core: Callable[[EventHandler], CoreClient], get_tokenizer: Callable[[], Any],
                 source: ModelSource, args: EngineArgs, observers: list[StepObserver] | None = None,
                 max_unread_outputs: int = DEFAULT_MAX_UNREAD_OUTPUTS) -> None:
        """`get_tokenizer` is called once the core has started. `max_unread_outputs`: a request
        whose reader leaves this many outputs unread is aborted (its reader stopped reading)."""
        self.observers = list(observers or [])
        self._args = args
        self.max_unread_outputs = max_unread_outputs
        self.num_unread_aborts = 0  # requests aborted because their reader stopped reading
        self.step_records: deque[StepRecord] = deque(maxlen=MAX_STEP_RECORDS)
        self._lock = threading.Lock()  # the registries below are shared with the event thread
        # The core knows each request by an id of its own, the caller's id plus a serial number: it
        # may still report a request this side has finished (a stop string's abort reaches it a
        # step late), and that must never reach a newer request with the caller's id.
        self._core_ids: dict[str, str] = {}  # caller's id -> core id, while the request lives
        self._serial = itertools.count()
        self._accepting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future, asyncio.Queue, str, bool]] = {}
        # by core id: the caller's loop, the request's outputs, the caller's id, whether only its last output counts
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, str, bool]] = {}
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}  # CallCore tickets
        self._exports: dict[int, tuple[str, str]] = {}  # ExportRequest tickets -> (core id, mode)
        self._tickets = itertools.count()
        self._dead: EngineDeadError | None = None
        self._stopped = threading.Event()
        # called (on a thread of its own) with the reason when the engine core dies unasked
        self.on_engine_death: Callable[[str], None] | None = None
        self._start_core = start_core
        self._generation = 0  # of the engine core: events of a core that was replaced are dropped
        self._restarting = threading.Lock()
        self._core = start_core(functools.partial(self._on_event, 0))
        self.info = self._core.info
        self.tokenizer: Any = get_tokenizer()
        self.input_processor, self.output_processor, self.generation_defaults = Frontend.from_args(
            args, self.tokenizer, source, self.info)
        # Tokenizing and chat templates run here, never on the event loop (a long prompt would stall
        # every stream) nor in the engine core; the tokenizer's encode releases the GIL.
        self._text_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="chunkserve-tokenize")

    @classmethod
    def from_engine_args(cls, args: EngineArgs, max_waiting_requests: int | None = None,
                         observers: list[StepObserver] | None = None, multiprocess: bool = True,
                         max_unread_outputs: int = DEFAULT_MAX_UNREAD_OUTPUTS,
                         started: EngineProcess | None = None) -> AsyncLLM:
        """Build the engine from `args`: in its own process (default; `started`: that process,
        already started for `args`) or on a thread. A restart starts a new process."""
        if not multiprocess:
            return cls.from_engine(LLMEngine(args), max_waiting_requests, observers, max_unread_outputs)
        source = resolve_model(args.model)
        loaded: dict[str, Any] = {}

        def load() -> None:  # while the engine process loads the model
            loaded["tokenizer"] = load_tokenizer(source, args.tokenizer, args.chat_template)

        def start(on_event: EventHandler) -> ProcessCore:
            nonlocal started
            process, started = started, None  # the first core adopts it; a restart starts its own
            return ProcessCore(args, on_event, max_waiting_requests, while_loading=load, started=process)

        return cls(start, lambda: loaded["tokenizer"], source, args, observers, max_unread_outputs)

    @classmethod
    def from_engine(cls, engine: LLMEngine, max_waiting_requests: int | None = None,
                    observers: list[StepObserver] | None = None,
                    max_unread_outputs: int = DEFAULT_MAX_UNREAD_OUTPUTS) -> AsyncLLM:
        """Run `engine`'s core on a thread of this process; after `shutdown()` it is the caller's again."""
        source = resolve_model(engine.args.model)
        return cls(lambda on_event: ThreadCore(engine.engine_core, engine.info, on_event, max_waiting_requests),
                   lambda: engine.tokenizer, source, engine.args, observers, max_unread_outputs)

    @property
    def scheduling_policy(self) -> str:
        return self._args.scheduling_policy

    @property
    def num_requests_in_flight(self) -> int:
        """Requests added and not yet finished (their streams are open)."""
        return len(self._streams)

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._core.is_alive()

    # ----- the caller's side (event loop) --------------------------------------------------

    async def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                          priority: int = 0, cache_salt: str | None = None,
                          kv_transfer_params: TransferParams | None = None,
                          add_special_tokens: bool = True) -> RequestStream:
        """Queue a request; returns once the engine accepted it. Raises InvalidRequestError
        or ServerOverloadedError if it is refused. The prompt is tokenized off the event loop
        (`add_special_tokens`: whether a text prompt gets BOS and the like, vLLM's completions field).
        `kv_transfer_params`: a disaggregated instance's pairing (from the router)."""
        loop = asyncio.get_running_loop()
        core_id = f"{request_id}#{next(self._serial)}"
        request, text = await loop.run_in_executor(
            self._text_pool, functools.partial(self.input_processor.process, core_id, prompt, params, priority,
                                               cache_salt=cache_salt, kv_transfer_params=kv_transfer_params,
                                               add_special_tokens=add_special_tokens))
        return await self._submit(request, request_id, AddRequest(request),
                                  functools.partial(self.output_processor.add_request, request, text, request_id))

    async def _submit(self, request: EngineCoreRequest, request_id: str, command: AddRequest | ImportRequest,
                      track: Callable[[], None]) -> RequestStream:
        """Register `request` under the caller's `request_id` (with `track`, the output processor's
        side), send `command` and return its stream once the core accepted it."""
        loop = asyncio.get_running_loop()
        accepted, outputs = loop.create_future(), asyncio.Queue()
        core_id = request.request_id
        final_only = request.sampling_params.output_kind == RequestOutputKind.FINAL_ONLY
        with self._lock:
            self._check_alive()
            if request_id in self._core_ids:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            track()
            self._core_ids[request_id] = core_id
            self._accepting[core_id] = (loop, accepted, outputs, request_id, final_only)
        self._core.send(command)
        abort = functools.partial(self._abort_in_core, [core_id])
        try:
            await accepted
        except asyncio.CancelledError:
            abort()
            raise
        return RequestStream(request_id, outputs, abort)

    async def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                                  **options: Any) -> list[int] | MultiModalPrompt:
        """A conversation -> prompt token ids, with its images loaded, decoded and expanded where it
        has any (all off the event loop, like tokenizing); `options`: the input processor's
        (continue_final_message, chat_template, chat_template_kwargs, documents, add_special_tokens,
        tools)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._text_pool, functools.partial(self.input_processor.apply_chat_template, messages,
                                               add_generation_prompt, **options))

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing done) while any request is unfinished,
        counting those added before this call."""
        return await self._call_core("reset_prefix_cache")

    async def check(self) -> dict:
        """The engine core's self-check (EngineCore.check): ok when idle and consistent."""
        return await self._call_core("check")

    async def cached_blocks(self) -> dict:
        """What the caches hold now, as KV events name it (EngineCore.cached_blocks)."""
        return await self._call_core("cached_blocks")

    async def _call_core(self, method: str) -> Any:
        loop = asyncio.get_running_loop()
        done, ticket = loop.create_future(), next(self._tickets)
        with self._lock:
            self._check_alive()
            self._calls[ticket] = (loop, done)
        self._core.send(CallCore(ticket, method))
        return await done

    async def export_request(self, request_id: str, mode: str = "copy",
                             skip_block_hashes: frozenset[bytes] = frozenset()) -> RequestSnapshot:
        """Snapshot a request in flight between two steps, with this frontend's state, so that
        another engine of the same model continues it (`import_request`). `pause` hands it
        over: its stream here ends with finish_reason "abort" and no more text. Blocks named in
        `skip_block_hashes` (the destination caches them) travel without their KV."""
        loop = asyncio.get_running_loop()
        done, ticket = loop.create_future(), next(self._tickets)
        with self._lock:
            self._check_alive()
            core_id = self._core_ids.get(request_id)
            if core_id is None:
                raise InvalidRequestError(f"no unfinished request {request_id!r} to export")
            self._calls[ticket] = (loop, done)
            self._exports[ticket] = (core_id, mode)
        self._core.send(ExportRequest(ticket, core_id, mode, frozenset(skip_block_hashes)))
        return await done

    def _finish_export(self, snapshot: RequestSnapshot | None, error: BaseException | None, core_id: str,
                       mode: str) -> tuple[RequestSnapshot | None, BaseException | None]:
        """On the event thread, in order with the steps' outputs: add the frontend's state as it
        stood when the core took the snapshot; a paused request's stream ends here."""
        request_id = client_request_id(core_id)
        if not self.output_processor.has_request(core_id):  # it finished before the export reached the core
            return None, InvalidRequestError(f"request {request_id!r} finished before it could be exported")
        if error is not None:  # the core's message, naming the request by the caller's id
            kind = InvalidRequestError if isinstance(error, InvalidRequestError) else RuntimeError
            return None, kind(str(error).replace(repr(core_id), repr(request_id)))
        snapshot.frontend_state = self.output_processor.export_state(core_id)
        if mode == "pause":
            last = self.output_processor.pause_for_export(core_id, time.time())
            stream = self._streams.pop(core_id, None)
            if stream is not None:
                loop, outputs, request_id, _ = stream
                del self._core_ids[request_id]
                _call_in(loop, outputs.put_nowait, last)
        return snapshot, None

    async def import_request(self, snapshot: RequestSnapshot, request_id: str | None = None,
                             output_kind: RequestOutputKind | None = None) -> RequestStream:
        """Continue an exported request here, under `request_id` (default: the id it was
        exported with); its stream continues where the exporter's stopped. `output_kind`
        replaces the one it was exported with. Raises InvalidRequestError if the snapshot does
        not fit this engine (nothing is taken), ServerOverloadedError if there is no room now."""
        if output_kind is not None:
            snapshot = dataclasses.replace(
                snapshot, sampling_params=dataclasses.replace(snapshot.sampling_params, output_kind=output_kind))
        request = imported_core_request(snapshot)
        external_id = request_id or request.request_id
        core_id = f"{external_id}#{next(self._serial)}"
        request.request_id = core_id
        return await self._submit(request, external_id, ImportRequest(snapshot, core_id), functools.partial(
            self.output_processor.add_imported, request, snapshot.output_token_ids, snapshot.frontend_state,
            external_id))

    def abort(self, request_id: str | list[str]) -> None:
        """Abort at the next step boundary; the blocks are back in the pool before the next step."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        with self._lock:
            core_ids = [self._core_ids[i] for i in ids if i in self._core_ids]
        self._abort_in_core(core_ids)

    def _abort_in_core(self, core_ids: list[str]) -> None:
        if core_ids:
            self._core.send(AbortRequests(core_ids))

    def abort_all(self) -> None:
        """Abort every request in flight (thread-safe: a signal handler or timer may call it)."""
        self._core.send(AbortRequests(None))

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort whatever is still in flight and stop the engine core."""
        if self._core.is_alive():
            self._core.send(Shutdown())
            self._stopped.wait(timeout_s)
        self._core.close(timeout_s)
        self._text_pool.shutdown(wait=False, cancel_futures=True)

    def restart(self) -> None:
        """Start a new engine core after the last one died (its requests were failed then); a
        call while another restart is under way does nothing."""
        if self.is_running:
            raise RuntimeError("the engine core is running; only a dead one is restarted")
        if not self._restarting.acquire(blocking=False):
            return
        try:
            self._core.close(timeout_s=30)  # a core stopped for a frontend failure may still be shutting down
            generation = self._generation + 1
            core = self._start_core(functools.partial(self._on_event, generation))
            with self._lock:
                self._core, self._generation = core, generation
                self._stopped.clear()
                self._dead = None
        finally:
            self._restarting.release()

    def _check_alive(self) -> None:
        if self._dead is not None or not self._core.is_alive():
            raise EngineDeadError("the engine is not running")

    # ----- the core's events (engine or receiver thread) -------------------------------------

    def _on_event(self, generation: int, event: Event) -> None:
        if generation != self._generation:
            return  # from a core that died and was replaced
        try:
            self._handle(event)
        except Exception as error:  # a bug on this side: fail every caller rather than leave them hanging
            logger.exception("the frontend could not handle the engine's %s", type(event).__name__)
            with self._lock:
                first = self._dead is None
                self._fail_everything(EngineDeadError(f"the frontend failed on the engine's events: {error!r}"))
            if first:  # the core's later events fail the same way: it is stopped and reported once
                self._core.send(Shutdown())
                self._report_death(f"the frontend failed on the engine's events: {error!r}")

    def _handle(self, event: Event) -> None:
        if isinstance(event, EngineCoreOutputs):
            self._deliver(event)
            return
        with self._lock:
            if isinstance(event, Accepted):
                loop, accepted, outputs, request_id, final_only = self._accepting.pop(event.request_id)
                if event.error is None:
                    self._streams[event.request_id] = (loop, outputs, request_id, final_only)
                else:
                    self.output_processor.remove_request(event.request_id)
                    del self._core_ids[request_id]
                _call_in(loop, _settle, accepted, event.error)
            elif isinstance(event, CoreCallResult):
                loop, done = self._calls.pop(event.ticket)
                result, error = event.result, event.error
                export = self._exports.pop(event.ticket, None)
                if export is not None:
                    result, error = self._finish_export(result, error, *export)
                _call_in(loop, _settle, done, error, result)
            elif isinstance(event, Stopped):
                self._fail_everything(EngineDeadError("the engine is shutting down"))
                self._stopped.set()
            elif isinstance(event, EngineDied):
                self._fail_everything(EngineDeadError(f"engine failed: {event.error!r}"))
                self._stopped.set()
                self._report_death(repr(event.error))

    def _deliver(self, update: EngineCoreOutputs) -> None:
        if update.record is not None:
            self.step_records.append(update.record)
        with self._lock:
            processed = self.output_processor.process_outputs(update.outputs, update.timestamp)
            self._abort_in_core(processed.requests_to_abort)  # stop strings: the core forgets them
            failures = processed.failed
            for core_id, item in [*processed.outputs.items(), *failures.items()]:
                stream = self._streams.get(core_id)
                if stream is None:
                    continue
                loop, outputs, request_id, final_only = stream
                if core_id in failures or item.finished:
                    del self._streams[core_id]
                    del self._core_ids[request_id]
                    item = failures.get(core_id, item)
                elif final_only:
                    continue
                _call_in(loop, self._put, core_id, outputs, item)
        for observer in self.observers:  # /metrics, the trace: their failure must not fail any request
            try:
                observer(update.record, processed.request_outputs, update.stats)
            except Exception:
                logger.exception("step observer %r failed", observer)

    def _report_death(self, reason: str) -> None:
        if self.on_engine_death is not None:
            threading.Thread(target=self.on_engine_death, args=(reason,), name="chunkserve-engine-death",
                             daemon=True).start()

    def _put(self, core_id: str, outputs: asyncio.Queue, item: RequestOutput | BaseException) -> None:
        """Hand an output to its reader (on the reader's loop). A reader that has left
        `max_unread_outputs` unread has stopped reading: its request is aborted and what it
        left is dropped, so a client that never reads cannot make the server buffer without bound."""
        if isinstance(item, BaseException) or item.finished or outputs.qsize() < self.max_unread_outputs:
            outputs.put_nowait(item)
            return
        with self._lock:
            stream = self._streams.pop(core_id, None)
            if stream is None:  # it ended meanwhile: its last output follows this one, so hand this one on
                outputs.put_nowait(item)
                return
            del self._core_ids[stream[2]]
        self._abort_in_core([core_id])
        self.num_unread_aborts += 1
        logger.warning("request %s aborted: its reader left %d outputs unread", stream[2], outputs.qsize())
        while not outputs.empty():
            outputs.get_nowait()
        outputs.put_nowait(RequestAbortedError(
            f"the request was aborted: {self.max_unread_outputs} of its outputs were left unread "
            "(the client stopped reading its stream)"))

    def _fail_everything(self, error: EngineDeadError) -> None:
        self._dead = error
        for loop, accepted, *_ in self._accepting.values():
            _call_in(loop, _settle, accepted, error)
        for loop, done in self._calls.values():
            _call_in(loop, _settle, done, error)
        for loop, outputs, *_ in self._streams.values():
            _call_in(loop, outputs.put_nowait, error)
        self._accepting.clear()
        self._calls.clear()
        self._exports.clear()
        self._streams.clear()
        self._core_ids.clear()
        self.output_processor = OutputProcessor(self.tokenizer)  # the failed requests' states go with them


def _call_in(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: object) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the loop is closed: its caller is gone
        pass


def _settle(future: asyncio.Future, error: BaseException | None, result: object = None) -> None:
    if future.done():  # the caller went away
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)

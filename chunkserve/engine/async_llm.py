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
import itertools
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from chunkserve.config.engine import EngineArgs
from chunkserve.config.model import ModelSource, resolve_model
from chunkserve.core.sched.output import SchedulerStats
from chunkserve.engine.core import MAX_STEP_RECORDS
from chunkserve.engine.core_client import CoreClient, EventHandler, ProcessCore, ThreadCore
from chunkserve.engine.input_processor import InputProcessor
from chunkserve.engine.llm_engine import LLMEngine
from chunkserve.engine.messages import (
    AbortRequests,
    Accepted,
    AddRequest,
    EngineCoreOutputs,
    EngineDied,
    Event,
    PrefixCacheReset,
    ResetPrefixCache,
    Shutdown,
    Stopped,
)
from chunkserve.engine.output_processor import OutputProcessor
from chunkserve.engine.outputs import RequestOutput, StepRecord
from chunkserve.engine.tokenizer import load_tokenizer
from chunkserve.errors import EngineDeadError, InvalidRequestError
from chunkserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Called after every step or batch of aborts: the step's record (None when no step ran), the
# outputs it produced, and the scheduler's state after it. It runs on the thread that receives
# the core's events (the engine thread itself when the core runs on a thread).
StepObserver = Callable[[StepRecord | None, list[RequestOutput], SchedulerStats], None]


class RequestStream:
    """One accepted request's outputs: one after every step that gave it a token, the last
    with `finished` set. Leaving the iteration early, or `abort()`, aborts the request."""

    def __init__(self, request_id: str, outputs: asyncio.Queue, abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self.finished = False
        self._outputs = outputs
        self._abort = abort

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
            self._abort(self.request_id)


class AsyncLLM:
    """`await`-able generation over an engine core; build it with `from_engine_args` or
    `from_engine`."""

    def __init__(self, start_core: Callable[[EventHandler], CoreClient], get_tokenizer: Callable[[], Any],
                 source: ModelSource, observers: list[StepObserver] | None = None) -> None:
        """`get_tokenizer` is called once the core has started."""
        self.observers = list(observers or [])
        self.step_records: deque[StepRecord] = deque(maxlen=MAX_STEP_RECORDS)
        self._lock = threading.Lock()  # the registries below are shared with the event thread
        self._accepting: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future, asyncio.Queue]] = {}
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._resets: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._tickets = itertools.count()
        self._dead: EngineDeadError | None = None
        self._stopped = threading.Event()
        self._core = start_core(self._on_event)
        self.info = self._core.info
        self.tokenizer: Any = get_tokenizer()
        self.input_processor = InputProcessor(self.tokenizer, source, self.info)
        self.output_processor = OutputProcessor(self.tokenizer)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, max_waiting_requests: int | None = None,
                         observers: list[StepObserver] | None = None, multiprocess: bool = True) -> AsyncLLM:
        """Build the engine from `args`: in its own process (default) or on a thread."""
        if not multiprocess:
            return cls.from_engine(LLMEngine(args), max_waiting_requests, observers)
        source = resolve_model(args.model)
        loaded: dict[str, Any] = {}

        def load() -> None:  # while the engine process loads the model
            loaded["tokenizer"] = load_tokenizer(source)

        return cls(lambda on_event: ProcessCore(args, on_event, max_waiting_requests, while_loading=load),
                   lambda: loaded["tokenizer"], source, observers)

    @classmethod
    def from_engine(cls, engine: LLMEngine, max_waiting_requests: int | None = None,
                    observers: list[StepObserver] | None = None) -> AsyncLLM:
        """Run `engine`'s core on a thread of this process; after `shutdown()` it is the caller's again."""
        source = resolve_model(engine.args.model)
        return cls(lambda on_event: ThreadCore(engine.engine_core, engine.info, on_event, max_waiting_requests),
                   lambda: engine.tokenizer, source, observers)

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._core.is_alive()

    # ----- the caller's side (event loop) --------------------------------------------------

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          priority: int = 0) -> RequestStream:
        """Queue a request; returns once the engine accepted it. Raises InvalidRequestError
        or ServerOverloadedError if it is refused."""
        loop = asyncio.get_running_loop()
        accepted, outputs = loop.create_future(), asyncio.Queue()
        request, text = self.input_processor.process(request_id, prompt, params, priority)
        with self._lock:
            self._check_alive()
            if request_id in self._accepting or request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            self._accepting[request_id] = (loop, accepted, outputs)
            self.output_processor.add_request(request, text)
        self._core.send(AddRequest(request))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return RequestStream(request_id, outputs, self.abort)

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing done) while any request is unfinished,
        counting those added before this call."""
        loop = asyncio.get_running_loop()
        done, ticket = loop.create_future(), next(self._tickets)
        with self._lock:
            self._check_alive()
            self._resets[ticket] = (loop, done)
        self._core.send(ResetPrefixCache(ticket))
        return await done

    def abort(self, request_id: str | list[str]) -> None:
        """Abort at the next step boundary; the blocks are back in the pool before the next step."""
        self._core.send(AbortRequests([request_id] if isinstance(request_id, str) else list(request_id)))

    def abort_all(self) -> None:
        """Abort every request in flight (thread-safe: a signal handler or timer may call it)."""
        self._core.send(AbortRequests(None))

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort whatever is still in flight and stop the engine core."""
        if self._core.is_alive():
            self._core.send(Shutdown())
            self._stopped.wait(timeout_s)
        self._core.join(timeout_s)

    def _check_alive(self) -> None:
        if self._dead is not None or not self._core.is_alive():
            raise EngineDeadError("the engine is not running")

    # ----- the core's events (engine or receiver thread) -------------------------------------

    def _on_event(self, event: Event) -> None:
        if isinstance(event, EngineCoreOutputs):
            self._deliver(event)
            return
        with self._lock:
            if isinstance(event, Accepted):
                loop, accepted, outputs = self._accepting.pop(event.request_id)
                if event.error is None:
                    self._streams[event.request_id] = (loop, outputs)
                else:
                    self.output_processor.remove_request(event.request_id)
                _call_in(loop, _settle, accepted, event.error)
            elif isinstance(event, PrefixCacheReset):
                loop, done = self._resets.pop(event.ticket)
                _call_in(loop, _settle, done, None, event.reset)
            elif isinstance(event, Stopped):
                self._fail_everything(EngineDeadError("the engine is shutting down"))
                self._stopped.set()
            elif isinstance(event, EngineDied):
                self._fail_everything(EngineDeadError(f"engine failed: {event.error!r}"))
                self._stopped.set()

    def _deliver(self, update: EngineCoreOutputs) -> None:
        if update.record is not None:
            self.step_records.append(update.record)
        with self._lock:
            processed = self.output_processor.process_outputs(update.outputs, update.timestamp)
            if processed.requests_to_abort:  # stop strings: sent before their streams end, so before any reuse of the id
                self._core.send(AbortRequests(processed.requests_to_abort))
            for output in processed.request_outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue
                if output.finished or update.step_error is not None:
                    del self._streams[output.request_id]
                loop, outputs = stream
                item = output if update.step_error is None else RuntimeError(update.step_error)
                _call_in(loop, outputs.put_nowait, item)
        for observer in self.observers:
            observer(update.record, processed.request_outputs, update.stats)

    def _fail_everything(self, error: EngineDeadError) -> None:
        self._dead = error
        for loop, accepted, _ in self._accepting.values():
            _call_in(loop, _settle, accepted, error)
        for loop, done in self._resets.values():
            _call_in(loop, _settle, done, error)
        for loop, outputs in self._streams.values():
            _call_in(loop, outputs.put_nowait, error)
        self._accepting.clear()
        self._resets.clear()
        self._streams.clear()


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

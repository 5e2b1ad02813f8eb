"""The engine behind the server: `LLMEngine` steps in its own thread, asyncio callers add,
stream and abort requests through a command queue, and never wait on a step.

One thread owns the engine, so nothing in it needs a lock. Commands (add, abort, reset the
prefix cache, stop) are
applied between steps in the order they were sent; each request's outputs reach its caller
through its own asyncio queue, one output per sampled token, the moment the step ends.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from chunkserve.config import EngineArgs
from chunkserve.core.scheduler_output import SchedulerStats
from chunkserve.engine.llm_engine import LLMEngine
from chunkserve.engine.outputs import RequestOutput, StepRecord
from chunkserve.errors import EngineDeadError, ServerOverloadedError
from chunkserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Called in the engine thread after every batch of commands or step: the step's record
# (None when no step ran), the outputs it produced, and the scheduler's state after it.
StepObserver = Callable[[StepRecord | None, list[RequestOutput], SchedulerStats], None]


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    loop: asyncio.AbstractEventLoop
    accepted: asyncio.Future
    outputs: asyncio.Queue


@dataclass
class _Abort:
    request_ids: list[str] | None  # None: every request in flight


@dataclass
class _ResetPrefixCache:
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future  # resolves to whether the cache was reset


@dataclass
class _Stop:
    done: threading.Event = field(default_factory=threading.Event)


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
    """`await`-able generation on an engine thread.

    `max_waiting_requests` (None: unlimited) refuses new requests with ServerOverloadedError
    while that many are already waiting for admission.
    """

    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None,
                 observers: list[StepObserver] | None = None) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.observers = list(observers or [])
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="chunkserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs) -> AsyncLLM:
        return cls(LLMEngine(args), **kwargs)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    # ----- the caller's side (event loop) --------------------------------------------------

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          priority: int = 0) -> RequestStream:
        """Queue a request; returns once the engine accepted it. Raises InvalidRequestError
        or ServerOverloadedError if it is refused."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        command = _Add(request_id, prompt, params, priority, loop, loop.create_future(), asyncio.Queue())
        self._commands.put(command)
        try:
            await command.accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return RequestStream(request_id, command.outputs, self.abort)

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing done) while any request is unfinished,
        counting those added before this call."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        command = _ResetPrefixCache(loop, loop.create_future())
        self._commands.put(command)
        return await command.done

    def abort(self, request_id: str | list[str]) -> None:
        """Abort at the next step boundary; the blocks are back in the pool before the next step."""
        self._commands.put(_Abort([request_id] if isinstance(request_id, str) else list(request_id)))

    def abort_all(self) -> None:
        """Abort every request in flight (thread-safe: a signal handler or timer may call it)."""
        self._commands.put(_Abort(None))

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort whatever is still in flight and stop the engine thread."""
        if not self.is_running:
            return
        stop = _Stop()
        self._commands.put(stop)
        stop.done.wait(timeout_s)
        self._thread.join(timeout_s)

    # ----- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                for command in self._take_commands(block=not busy):
                    if isinstance(command, _Stop):
                        self._notify(None, self._abort(None))
                        self._fail_pending_commands(EngineDeadError("the engine is shutting down"))
                        command.done.set()
                        return
                    self._apply(command)
                try:
                    self._step()
                except Exception as error:  # a bug this batch hit: fail its requests, keep serving
                    logger.exception("engine step failed; aborting every request in flight")
                    self._fail_all(RuntimeError(f"the engine step failed ({error!r}); the request was aborted"))
        except BaseException as error:  # a bug in the engine: fail every caller, never hang them
            logger.exception("engine loop died")
            for loop, outputs in self._streams.values():
                loop.call_soon_threadsafe(outputs.put_nowait, EngineDeadError(f"engine failed: {error!r}"))
            self._streams.clear()
            self._fail_pending_commands(error)

    def _take_commands(self, block: bool) -> list:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: _Add | _Abort | _ResetPrefixCache) -> None:
        if isinstance(command, _Abort):
            self._notify(None, self._abort(command.request_ids))
            return
        if isinstance(command, _ResetPrefixCache):
            command.loop.call_soon_threadsafe(_settle, command.done, None, self.engine.reset_prefix_cache())
            return
        try:
            waiting = self.engine.get_stats().num_waiting
            if self.max_waiting_requests is not None and waiting >= self.max_waiting_requests:
                raise ServerOverloadedError(f"{waiting} requests are already waiting; retry later")
            self.engine.add_request(command.request_id, command.prompt, command.params, command.priority)
        except Exception as error:  # refused (InvalidRequestError, ServerOverloadedError) or a bug: tell the caller
            command.loop.call_soon_threadsafe(_settle, command.accepted, error)
            return
        self._streams[command.request_id] = (command.loop, command.outputs)
        command.loop.call_soon_threadsafe(_settle, command.accepted, None)

    def _abort(self, request_ids: list[str] | None) -> list[RequestOutput]:
        outputs = self.engine.abort_request(list(self._streams) if request_ids is None else request_ids)
        self._deliver(outputs)
        return outputs

    def _step(self) -> None:
        if not self.engine.has_unfinished_requests():
            return
        outputs = self.engine.step()
        self._deliver(outputs)
        self._notify(self.engine.last_step_record, outputs)

    def _fail_all(self, error: Exception) -> None:
        streams, self._streams = self._streams, {}
        outputs = self.engine.abort_request(list(streams))
        for loop, outputs_queue in streams.values():
            loop.call_soon_threadsafe(outputs_queue.put_nowait, error)
        self._notify(None, outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            loop, outputs_queue = stream
            loop.call_soon_threadsafe(outputs_queue.put_nowait, output)

    def _notify(self, record: StepRecord | None, outputs: list[RequestOutput]) -> None:
        stats = self.engine.get_stats()
        for observer in self.observers:
            observer(record, outputs, stats)

    def _fail_pending_commands(self, error: BaseException) -> None:
        dead = error if isinstance(error, EngineDeadError) else EngineDeadError(f"engine failed: {error!r}")
        for command in self._take_commands(block=False):
            if isinstance(command, _Add):
                command.loop.call_soon_threadsafe(_settle, command.accepted, dead)
            elif isinstance(command, _ResetPrefixCache):
                command.loop.call_soon_threadsafe(_settle, command.done, dead)
            elif isinstance(command, _Stop):
                command.done.set()


def _settle(future: asyncio.Future, error: BaseException | None, result: object = None) -> None:
    if future.done():  # the caller went away
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)

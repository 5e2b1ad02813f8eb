"""The engine core: the loop that owns an `LLMEngine`, and the messages that drive it.

The loop takes commands (add, abort, reset the prefix cache, shut down) between steps, in the
order they were sent, and reports everything that happens as events: a request accepted or
refused, the outputs and record of each step, the engine's death. Commands and events are
plain picklable dataclasses, so the same loop runs on a thread beside the caller or, as
`chunkserve serve` runs it, in a process of its own (`run_engine_process`): there it shares no
GIL with the HTTP server, whose Python work otherwise stalls every torch op of a step on its
way back into the interpreter (measured in docs/BENCHMARKS.md, "Engine-core process").
"""

from __future__ import annotations

import logging
import pickle
import queue
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

from chunkserve.config import EngineArgs
from chunkserve.core.scheduler_output import SchedulerStats
from chunkserve.engine.llm_engine import LLMEngine
from chunkserve.engine.outputs import RequestOutput, StepRecord
from chunkserve.errors import ServerOverloadedError
from chunkserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


# ----- commands (caller -> engine) ----------------------------------------------------------

@dataclass
class AddRequest:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int = 0


@dataclass
class AbortRequests:
    request_ids: list[str] | None  # None: every request in flight


@dataclass
class ResetPrefixCache:
    ticket: int  # echoed in the PrefixCacheReset event that answers it


@dataclass
class Shutdown:
    """Abort whatever is in flight, answer `Stopped`, end the loop."""


Command = AddRequest | AbortRequests | ResetPrefixCache | Shutdown


# ----- events (engine -> caller) ------------------------------------------------------------

@dataclass(frozen=True)
class EngineInfo:
    """What the server needs to know of the engine it cannot see."""

    model_name: str
    max_model_len: int

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        return cls(model_name=engine.source.name, max_model_len=engine.max_model_len)


@dataclass
class Ready:
    info: EngineInfo


@dataclass
class Accepted:
    request_id: str
    error: BaseException | None  # None: queued; else why it was refused


@dataclass
class EngineUpdate:
    """A step ran (`record` set) or requests were aborted (`record` None). `step_error` set:
    the step failed, and `outputs` are the requests it aborted because of that."""

    record: StepRecord | None
    outputs: list[RequestOutput]
    stats: SchedulerStats
    step_error: str | None = None


@dataclass
class PrefixCacheReset:
    ticket: int
    reset: bool


@dataclass
class EngineDied:
    error: BaseException


@dataclass
class Stopped:
    pass


Event = Ready | Accepted | EngineUpdate | PrefixCacheReset | EngineDied | Stopped


class EngineCore:
    """Runs `engine` until `Shutdown`, reporting to `emit`. One thread owns the engine, so
    nothing in it needs a lock. A step that raises fails the requests it held and the loop goes
    on; anything else that raises ends the loop with `EngineDied`.

    `max_waiting_requests` (None: unlimited) refuses new requests with ServerOverloadedError
    while that many are already waiting for admission.
    """

    def __init__(self, engine: LLMEngine, emit: Callable[[Event], None],
                 max_waiting_requests: int | None = None) -> None:
        self.engine = engine
        self.emit = emit
        self.max_waiting_requests = max_waiting_requests
        self._live: set[str] = set()  # accepted and not finished

    def run(self, commands: queue.SimpleQueue) -> None:
        try:
            while True:
                for command in _take(commands, block=not self.engine.has_unfinished_requests()):
                    if isinstance(command, Shutdown):
                        self._abort(None)
                        self.emit(Stopped())
                        return
                    self._apply(command)
                self._step()
        except BaseException as error:  # a bug in the engine: tell the caller, never hang it
            logger.exception("engine loop died")
            try:
                self.emit(EngineDied(_picklable(error)))
            except OSError:  # the caller is gone too (the process transport's pipe is closed)
                pass

    def _apply(self, command: Command) -> None:
        if isinstance(command, AbortRequests):
            self._abort(command.request_ids)
        elif isinstance(command, ResetPrefixCache):
            self.emit(PrefixCacheReset(command.ticket, self.engine.reset_prefix_cache()))
        else:
            self.emit(Accepted(command.request_id, self._add(command)))

    def _add(self, command: AddRequest) -> BaseException | None:
        try:
            waiting = self.engine.get_stats().num_waiting
            if self.max_waiting_requests is not None and waiting >= self.max_waiting_requests:
                raise ServerOverloadedError(f"{waiting} requests are already waiting; retry later")
            self.engine.add_request(command.request_id, command.prompt, command.params, command.priority)
        except Exception as error:  # refused (InvalidRequestError, ServerOverloadedError) or a bug
            return _picklable(error)
        self._live.add(command.request_id)
        return None

    def _abort(self, request_ids: list[str] | None) -> None:
        ids = list(self._live) if request_ids is None else [i for i in request_ids if i in self._live]
        if ids:
            self._update(None, self.engine.abort_request(ids))

    def _step(self) -> None:
        if not self.engine.has_unfinished_requests():
            return
        try:
            outputs = self.engine.step()
        except Exception as error:  # a bug this batch hit: fail its requests, keep serving
            logger.exception("engine step failed; aborting every request in flight")
            message = f"the engine step failed ({error!r}); the request was aborted"
            self._update(None, self.engine.abort_request(list(self._live)), message)
            return
        self._update(self.engine.last_step_record, outputs)

    def _update(self, record: StepRecord | None, outputs: list[RequestOutput], step_error: str | None = None) -> None:
        self._live.difference_update(o.request_id for o in outputs if o.finished)
        self.emit(EngineUpdate(record, outputs, self.engine.get_stats(), step_error))


def _take(commands: queue.SimpleQueue, block: bool) -> list[Command]:
    taken = [commands.get()] if block else []
    while True:
        try:
            taken.append(commands.get_nowait())
        except queue.Empty:
            return taken


def _picklable(error: BaseException) -> BaseException:
    """`error` itself when it survives pickling (the process transport), else a RuntimeError
    with its repr."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(repr(error))


def run_engine_process(args: EngineArgs, max_waiting_requests: int | None, commands_conn, events_conn,
                       log_level: int) -> None:
    """The engine-core process's main: build the engine, answer `Ready` (or `EngineDied` if it
    cannot be built), then run the loop. Stop signals are left to the server, which shuts the
    engine down with `Shutdown` after its graceful-shutdown window; if the server dies, the
    command pipe closes and the engine shuts down by itself."""
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        engine = LLMEngine(args)
    except BaseException as error:
        events_conn.send(EngineDied(_picklable(error)))
        return
    commands: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_receive_commands, args=(commands_conn, commands), daemon=True,
                     name="chunkserve-commands").start()
    events_conn.send(Ready(EngineInfo.of(engine)))
    EngineCore(engine, events_conn.send, max_waiting_requests).run(commands)


def _receive_commands(conn, commands: queue.SimpleQueue) -> None:
    """Pumps the pipe into the loop's queue, so commands pile up while a step runs instead of
    blocking the server's sends on a full pipe."""
    while True:
        try:
            commands.put(conn.recv())
        except (EOFError, OSError):  # the server is gone
            commands.put(Shutdown())
            return

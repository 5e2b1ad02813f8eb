"""The loop that drives an `EngineCore` from commands and reports events (messages.py).

The loop takes commands (add, abort, reset the prefix cache, shut down) between steps, in the
order they were sent, and reports everything that happens as events. It runs on a thread
beside the caller or, as `chunkserve serve` runs it, in a process of its own
(`run_engine_process`): there it shares no GIL with the HTTP server, whose Python work
otherwise stalls every torch op of a step on its way back into the interpreter (measured in
docs/benchmarks-log.md, "The engine core in a process of its own").
"""

from __future__ import annotations

import logging
import pickle
import queue
import signal
import threading
from collections.abc import Callable

from chunkserve.config.engine import EngineArgs
from chunkserve.config.model import resolve_model
from chunkserve.core.messages import EngineCoreOutput
from chunkserve.engine.core import EngineCore
from chunkserve.engine.messages import (
    AbortRequests,
    Accepted,
    AddRequest,
    CallCore,
    Command,
    CoreCallResult,
    EngineCoreOutputs,
    EngineDied,
    Event,
    ExportRequest,
    ImportRequest,
    Ready,
    Shutdown,
    Stopped,
    WorkersFailed,
)
from chunkserve.engine.outputs import StepRecord
from chunkserve.errors import EngineDeadError, ServerOverloadedError

logger = logging.getLogger(__name__)


class EngineCoreLoop:
    """Runs `core` until `Shutdown`, reporting to `emit`. One thread owns the core, so
    nothing in it needs a lock. A step the executor fails fails only the requests found to cause
    it (the core's triage); if the core's own code raises in a step, every request in flight
    is failed and the loop goes on; anything else that raises ends the loop with `EngineDied`.

    `max_waiting_requests` (None: unlimited) refuses new requests with ServerOverloadedError
    while that many are already waiting for admission.
    """

    def __init__(self, core: EngineCore, emit: Callable[[Event], None], max_waiting_requests: int | None = None) -> None:
        self.core = core
        self.emit = emit
        self.max_waiting_requests = max_waiting_requests

    def run(self, commands: queue.SimpleQueue) -> None:
        self.core.executor.set_failure_callback(lambda error: commands.put(WorkersFailed(error)))
        try:
            while True:
                for command in _take(commands, block=not self.core.has_unfinished_requests()):
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
        if isinstance(command, WorkersFailed):
            raise command.error
        if isinstance(command, AbortRequests):
            self._abort(command.request_ids)
        elif isinstance(command, CallCore):
            self.emit(CoreCallResult(command.ticket, getattr(self.core, command.method)()))
        elif isinstance(command, ExportRequest):
            try:
                snapshot = self.core.export_request(command.request_id, command.mode, command.skip_block_hashes)
            except Exception as error:  # refused (InvalidRequestError) or a bug: the caller is told
                self.emit(CoreCallResult(command.ticket, None, _picklable(error)))
            else:
                self.emit(CoreCallResult(command.ticket, snapshot))
        elif isinstance(command, ImportRequest):
            self.emit(Accepted(command.request_id, self._add(command)))
        else:
            self.emit(Accepted(command.request.request_id, self._add(command)))

    def _add(self, command: AddRequest | ImportRequest) -> BaseException | None:
        try:
            waiting = self.core.get_stats().num_waiting
            if self.max_waiting_requests is not None and waiting >= self.max_waiting_requests:
                raise ServerOverloadedError(f"{waiting} requests are already waiting; retry later")
            if isinstance(command, ImportRequest):
                self.core.import_request(command.snapshot, command.request_id)
            else:
                self.core.add_request(command.request)
        except Exception as error:  # refused (InvalidRequestError, ServerOverloadedError) or a bug
            return _picklable(error)
        return None

    def _abort(self, request_ids: list[str] | None) -> None:
        ids = self.core.unfinished_request_ids() if request_ids is None else request_ids
        aborted = self.core.abort_requests(ids)
        if aborted:
            self._emit_outputs(None, aborted)

    def _step(self) -> None:
        if not self.core.has_unfinished_requests():
            return
        try:
            step = self.core.step()
        except EngineDeadError:  # the workers are gone: the loop ends
            raise
        except Exception as error:  # a bug in the scheduler: its state is suspect, fail everything in flight
            logger.exception("engine step failed outside the executor; aborting every request in flight")
            message = f"the engine step failed ({error!r}); the request was aborted"
            aborted = self.core.abort_requests(self.core.unfinished_request_ids())
            self._emit_outputs(None, [output._replace(error=message) for output in aborted])
            return
        if step is not None:
            self.emit(step)

    def _emit_outputs(self, record: StepRecord | None, outputs: list[EngineCoreOutput]) -> None:
        self.emit(EngineCoreOutputs(outputs, self.core.clock.time(), record, self.core.get_stats()))


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
    """The engine-core process's main: build the core, answer `Ready` (or `EngineDied` if it
    cannot be built), then run the loop. Stop signals are left to the server, which shuts the
    engine down with `Shutdown` after its graceful-shutdown window; if the server dies, the
    command pipe closes and the engine shuts down by itself."""
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        core = EngineCore(args)
        info = core.info(resolve_model(args.model).name)
    except BaseException as error:
        events_conn.send(EngineDied(_picklable(error)))
        return
    commands: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_receive_commands, args=(commands_conn, commands), daemon=True,
                     name="chunkserve-commands").start()
    events_conn.send(Ready(info))
    core.structured.prepare()  # this process has no tokenizer yet: the first grammar would load it
    try:
        EngineCoreLoop(core, events_conn.send, max_waiting_requests).run(commands)
    finally:
        core.shutdown()  # the executor's workers go with the process


def _receive_commands(conn, commands: queue.SimpleQueue) -> None:
    """Pumps the pipe into the loop's queue, so commands pile up while a step runs instead of
    blocking the server's sends on a full pipe."""
    while True:
        try:
            commands.put(conn.recv())
        except (EOFError, OSError):  # the server is gone
            commands.put(Shutdown())
            return

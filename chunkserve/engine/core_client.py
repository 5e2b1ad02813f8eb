"""How the frontend reaches the engine core: on a thread of this process (`ThreadCore`) or
in a process of its own (`ProcessCore`). Both take commands and hand every event to the
frontend's handler (messages.py); the frontend cannot tell them apart."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from chunkserve.config.engine import EngineArgs
from chunkserve.engine.core import EngineCore
from chunkserve.engine.core_loop import EngineCoreLoop
from chunkserve.engine.core_process import EngineProcess, start_engine_process
from chunkserve.engine.messages import Command, EngineDied, EngineInfo, Event, Ready, Shutdown, Stopped
from chunkserve.errors import EngineDeadError

logger = logging.getLogger(__name__)

EventHandler = Callable[[Event], None]


class ThreadCore:
    """The engine core on a thread of this process, over a core the caller keeps."""

    def __init__(self, core: EngineCore, info: EngineInfo, on_event: EventHandler,
                 max_waiting_requests: int | None) -> None:
        self.info = info
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        loop = EngineCoreLoop(core, on_event, max_waiting_requests)
        self._thread = threading.Thread(target=loop.run, args=(self._commands,), name="chunkserve-engine",
                                        daemon=True)
        self._thread.start()

    def send(self, command: Command) -> None:
        self._commands.put(command)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout_s: float) -> None:
        """Wait for the loop to end (after Shutdown, or its death)."""
        self._thread.join(timeout_s)


class ProcessCore:
    """The engine core in a process of its own (core_process.py), talking over two pipes.
    Commands go through a sender thread, so the event loop never blocks on a full pipe; events
    arrive on a receiver thread. Construction returns once the engine is built, and raises what
    building it raised (ModelLoadError, InvalidRequestError, ...). `while_loading` runs here
    while the engine process loads (the frontend's tokenizer). `started`: a process already
    started for `args` (`chunkserve serve` starts it before loading the frontend); else one is
    started now."""

    def __init__(self, args: EngineArgs, on_event: EventHandler, max_waiting_requests: int | None,
                 while_loading: Callable[[], None] = lambda: None, started: EngineProcess | None = None) -> None:
        engine = started or start_engine_process(args, max_waiting_requests)
        self._process, self._commands, self._events = engine.process, engine.commands, engine.events
        try:
            while_loading()
            self.info = self._wait_ready()
        except BaseException:
            engine.kill()
            raise
        self._on_event = on_event
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_commands, name="chunkserve-core-send", daemon=True)
        self._sender.start()
        self._receiver = threading.Thread(target=self._receive_events, name="chunkserve-core-receive", daemon=True)
        self._receiver.start()

    def _wait_ready(self) -> EngineInfo:
        try:
            first = self._events.recv()
        except EOFError:
            self._process.join(5)
            raise EngineDeadError(f"the engine process exited (code {self._process.exitcode}) before it was ready")
        if isinstance(first, EngineDied):
            raise first.error
        assert isinstance(first, Ready), first
        return first.info

    def send(self, command: Command) -> None:
        self._outbox.put(command)

    def is_alive(self) -> bool:
        return self._process.is_alive()

    def close(self, timeout_s: float) -> None:
        """Wait for the process to end (after Shutdown, or its death; killed after `timeout_s`),
        then let the sender thread go and close the pipes."""
        self._process.join(timeout_s)
        if self._process.is_alive():
            logger.warning("the engine process did not stop within %.0f s; killing it", timeout_s)
            self._process.kill()
            self._process.join()
        self._receiver.join(timeout_s)
        self._outbox.put(Shutdown())  # the sender ends on it (or on the closed pipe)
        self._sender.join(timeout_s)
        self._commands.close()
        self._events.close()

    def _send_commands(self) -> None:
        while True:
            command = self._outbox.get()
            try:
                self._commands.send(command)
            except OSError:  # the process is gone; the receiver reports it
                return
            if isinstance(command, Shutdown):
                return

    def _receive_events(self) -> None:
        while True:
            try:
                event = self._events.recv()
            except (EOFError, OSError):
                self._process.join(5)
                code = self._process.exitcode
                self._on_event(EngineDied(EngineDeadError(f"the engine process exited unexpectedly (code {code})")))
                return
            self._on_event(event)
            if isinstance(event, (Stopped, EngineDied)):
                return


CoreClient = ThreadCore | ProcessCore

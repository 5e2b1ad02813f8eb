"""The engine-core process: started (`start_engine_process`) without torch or the engine core
loaded in the starting process, so that `chunkserve serve` can start it first and load its own
frontend while the process loads the model; `ProcessCore` (core_client.py) then talks to it.
The process's main imports the engine core there, in the child."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from chunkserve.config.engine import EngineArgs
from chunkserve.executor.cpu_threads import plan_threads, thread_environment

logger = logging.getLogger(__name__)


@dataclass
class EngineProcess:
    """A started engine-core process and this side's ends of its two pipes."""

    process: BaseProcess
    commands: Connection  # to the core
    events: Connection  # from the core: `Ready` (or `EngineDied`) first

    def kill(self) -> None:
        """For a start abandoned before anyone talks to the core."""
        self.process.kill()
        self.process.join()
        self.commands.close()
        self.events.close()


def start_engine_process(args: EngineArgs, max_waiting_requests: int | None) -> EngineProcess:
    """Spawn (no torch state is forked) the engine core's process, with its compute threads'
    environment; returns at once, while the process loads the model."""
    plan = plan_threads(args.cpu_omp_threads_bind) if args.executor_backend == "uni" else None
    environment = thread_environment(plan, os.environ)
    if plan is not None:
        logger.info("engine compute threads: %s", plan.summary(environment))
    context = multiprocessing.get_context("spawn")
    commands_child, commands = context.Pipe(duplex=False)
    events, events_child = context.Pipe(duplex=False)
    process = context.Process(
        target=_engine_main, name="chunkserve-engine-core", daemon=True,
        args=(args, max_waiting_requests, commands_child, events_child, logging.getLogger().getEffectiveLevel()),
    )
    with _environment(environment):  # the child's torch reads it as it loads
        process.start()
    commands_child.close()
    events_child.close()
    return EngineProcess(process, commands, events)


def _engine_main(*args) -> None:
    """The child's entry point: the engine core's modules (torch, the model) load here only."""
    from chunkserve.engine.core_loop import run_engine_process

    run_engine_process(*args)


@contextlib.contextmanager
def _environment(environment: dict[str, str]) -> Iterator[None]:
    """os.environ has `environment`'s values inside (a spawned process inherits them), its own after."""
    changed = {name: os.environ.get(name) for name, value in environment.items() if os.environ.get(name) != value}
    os.environ.update({name: environment[name] for name in changed})
    try:
        yield
    finally:
        for name, value in changed.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value

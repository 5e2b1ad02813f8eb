"""The executor interface between the engine core and its workers.

The engine core calls only these; an executor decides where the workers run. Every call but
`execute_model` is a set-up call made once; `collective_rpc` runs a worker method on every
worker and returns each one's answer (rank order)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from chunkserve.core.messages import ModelRunnerOutput, SchedulerOutput
from chunkserve.model.config import ModelConfig


class StepHandle(ABC):
    """A step handed to the workers (`Executor.submit`), whose output may not be back yet."""

    @abstractmethod
    def result(self) -> ModelRunnerOutput:
        """Wait for the step's output; raises what the step raised."""


class Executor(ABC):
    model_config: ModelConfig  # the model's shape, as the workers read it

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call `method` on every worker; their results, rank order."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every worker; the output of the one that samples."""

    def submit(self, scheduler_output: SchedulerOutput) -> StepHandle:
        """Hand a step to the workers without waiting for it: executors that run a
        pipeline (ParallelConfig.max_steps_in_flight above 1) implement it."""
        raise NotImplementedError(f"{type(self).__name__} runs one step at a time: call execute_model")

    def cpu_threads(self) -> dict | None:
        """The compute threads of this process's worker (executor/cpu_threads.py); None where the
        workers run in processes of their own."""
        return None

    def set_failure_callback(self, callback: Callable[[BaseException], None]) -> None:
        """`callback(error)` is called (from any thread) when the workers fail while the engine
        is not waiting on them; executors whose workers cannot die apart from the engine ignore it."""

    def determine_num_kv_blocks(self) -> int:
        """KV blocks every worker can hold: the smallest of theirs."""
        return min(self.collective_rpc("determine_num_kv_blocks"))

    def load_model(self, max_model_len: int) -> None:
        self.collective_rpc("load_model", (max_model_len,))

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_kv_cache", (num_blocks,))

    def profile(self, rows: list[tuple[int, int]], seed: int = 0) -> float:
        """Seconds of one synthetic step (see `Worker.profile`): the slowest worker's."""
        return max(self.collective_rpc("profile", (rows, seed)))

    def shutdown(self) -> None:
        """Release the workers; the executor is unusable afterwards."""

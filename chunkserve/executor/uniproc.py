"""One worker in the engine core's own process: the default executor."""

from __future__ import annotations

from typing import Any

from chunkserve.config.engine import EngineArgs
from chunkserve.core.kv_connector import KVConnectorWorker
from chunkserve.core.messages import ModelRunnerOutput, SchedulerOutput
from chunkserve.executor.base import Executor
from chunkserve.executor.cpu_threads import apply_in_process, current_threads, plan_threads
from chunkserve.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineArgs, kv_connector: KVConnectorWorker | None = None) -> None:
        apply_in_process(plan_threads(config.cpu_omp_threads_bind))
        self.worker = Worker(config, kv_connector)
        self.model_config = self.worker.model_config

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def cpu_threads(self) -> dict:
        return current_threads()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        self.worker = None

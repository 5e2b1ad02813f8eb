"""One simulated engine: the real `EngineCore` (scheduler, KV cache manager, prefix cache,
chunk and admission policies, drafting policy) on a `VirtualClock`, its steps timed by a
`StepTimer`, with what the client would see of each request.

The replica takes requests as the engine core does between steps: a request reaches the core
`request_latency_s` after its arrival and is added before the first step that starts after
that; a token reaches the client `output_latency_s` after the step that made it ends.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from chunkserve.bench.client import RequestResult
from chunkserve.config.engine import EngineArgs
from chunkserve.core.clock import VirtualClock
from chunkserve.core.kv.kv_cache_manager import hash_block, root_hash
from chunkserve.core.messages import SchedulerOutput
from chunkserve.engine.core import EngineCore
from chunkserve.engine.messages import EngineCoreRequest
from chunkserve.executor.simulated import SimulatedExecutor
from chunkserve.model.config import ModelConfig
from chunkserve.sampling_params import SamplingParams
from chunkserve.sim.timing import ProfileTimer, ReplayTimer


MAX_IDLE_S = 60.0  # an engine that schedules nothing this long while it holds requests never will


@dataclass(frozen=True)
class Latencies:
    """The ways into and out of the engine core that a step trace does not see."""

    request_s: float = 0.0
    output_s: float = 0.0


class RecordingExecutor(SimulatedExecutor):
    """Keeps every step's `SchedulerOutput`: the replay test compares them with a real run's."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[SchedulerOutput] = []

    def execute_model(self, scheduler_output: SchedulerOutput):
        self.steps.append(scheduler_output)
        return super().execute_model(scheduler_output)


class Replica:
    def __init__(self, engine_args: EngineArgs, model_config: ModelConfig, num_blocks: int,
                 timer: ProfileTimer | ReplayTimer, latencies: Latencies = Latencies(), start_time: float = 0.0,
                 record_steps: bool = False) -> None:
        self.clock = VirtualClock(start_time)
        self.timer = timer
        self.latencies = latencies
        executor_class = RecordingExecutor if record_steps else SimulatedExecutor
        self.executor = executor_class(model_config, num_blocks, timer, self.clock)
        self.core = EngineCore(engine_args, self.executor, clock=self.clock)
        self._pending: list[tuple[float, int, str, EngineCoreRequest]] = []  # (reaches the core, order, id, request)
        self._order = itertools.count()
        self.results: dict[str, RequestResult] = {}
        self._idle_s = 0.0  # simulated seconds since the last step while requests were unfinished
        self.load = 0  # requests sent here and not finished: what a least-load router reads

    # ----- what a router reads ---------------------------------------------------------------

    def cached_prefix_tokens(self, prompt: tuple[int, ...]) -> int:
        """Prompt tokens this replica's prefix cache holds now (read only)."""
        kv = self.core.scheduler.kv
        size = kv.block_size
        parent, hashes = root_hash(None), []
        for start in range(0, len(prompt) - size + 1, size):
            parent = hash_block(parent, prompt[start:start + size])
            hashes.append(parent)
        return len(kv.cached_run(hashes)) * size

    # ----- the simulation ----------------------------------------------------------------------

    def submit(self, request_id: str, prompt: tuple[int, ...], output_len: int, arrival: float, kind: str,
               priority: int = 0) -> None:
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
        reaches = arrival + self.latencies.request_s
        core_request = EngineCoreRequest(request_id, list(prompt), params, None, reaches, priority)
        heapq.heappush(self._pending, (reaches, next(self._order), request_id, core_request))
        self.results[request_id] = RequestResult(kind, len(prompt), output_len, arrival)
        self.load += 1

    def next_event(self) -> float | None:
        """When this replica next does something: its next step (now, while it has work) or the
        next request reaching its core; None when it has neither."""
        if self.core.has_unfinished_requests():
            return self.clock.now
        return self._pending[0][0] if self._pending else None

    def advance(self) -> list[str]:
        """Take in the requests that reached the core, run one step; the ids that finished in it."""
        if not self.core.has_unfinished_requests() and self._pending:
            self.clock.advance_to(self._pending[0][0])
        added, finished = 0, []
        while self._pending and self._pending[0][0] <= self.clock.now:
            self.core.add_request(heapq.heappop(self._pending)[3])
            added += 1
        step = self.core.step()
        if step is not None:
            self._idle_s = 0.0
            seen = self.clock.now + self.latencies.output_s
            for output in step.outputs:
                result = self.results[output.request_id]
                if output.new_token_ids:
                    result.token_times.append(seen)
                    result.completion_tokens += len(output.new_token_ids)
                if output.finished:
                    result.end_time, result.ok = seen, output.finish_reason != "abort"
                    result.cached_tokens = output.num_cached_tokens
                    result.error = output.error
                    finished.append(output.request_id)
                    self.load -= 1
            if step.record is not None:
                self.clock.advance(self.timer.gap_seconds())
        elif self.core.has_unfinished_requests() and not added:  # the engine loop turns while time passes
            self._idle_s += self.timer.idle_seconds()
            self.clock.advance(self.timer.idle_seconds())
            if self._idle_s > MAX_IDLE_S:
                raise RuntimeError(f"the simulated engine scheduled nothing for {MAX_IDLE_S:.0f} simulated seconds "
                                   f"while holding {len(self.core.unfinished_request_ids())} request(s)")
        return finished

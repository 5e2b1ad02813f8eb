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
from chunkserve.core.disagg.protocol import TransferParams
from chunkserve.core.kv.kv_cache_manager import hash_block, root_hash
from chunkserve.core.kv_connector import KVConnectorScheduler
from chunkserve.core.messages import SchedulerOutput
from chunkserve.engine.core import EngineCore
from chunkserve.engine.input_processor import resolve_max_tokens
from chunkserve.engine.messages import EngineCoreRequest
from chunkserve.errors import InvalidRequestError
from chunkserve.executor.simulated import SimulatedConnector, SimulatedExecutor, SyntheticText
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
    """`connector` and `kv_connector`: a prefill or decode instance's two sides of the KV
    connector (sim/disagg.py's worker side on a simulated link; the engine's scheduler side).
    `text`: the outputs' text, for speculative decoding (its drafts are verified against it)."""

    def __init__(self, engine_args: EngineArgs, model_config: ModelConfig, num_blocks: int,
                 timer: ProfileTimer | ReplayTimer, latencies: Latencies = Latencies(), start_time: float = 0.0,
                 record_steps: bool = False, clock: VirtualClock | None = None,
                 connector: SimulatedConnector | None = None, kv_connector: KVConnectorScheduler | None = None,
                 text: SyntheticText | None = None) -> None:
        self.clock = clock or VirtualClock(start_time)
        self.timer = timer
        self.latencies = latencies
        self.connector = connector
        executor_class = RecordingExecutor if record_steps else SimulatedExecutor
        self.executor = executor_class(model_config, num_blocks, timer, self.clock, connector, text)
        self.core = EngineCore(engine_args, self.executor, kv_connector=kv_connector, clock=self.clock)
        self._pending: list[tuple[float, int, str, EngineCoreRequest]] = []  # (reaches the core, order, id, request)
        self._order = itertools.count()
        self.results: dict[str, RequestResult] = {}
        self._idle_s = 0.0  # simulated seconds of turns since the last step while requests were unfinished
        self._wake: float | None = None  # after a turn that ran nothing: when to turn again (None: on an event)
        self._idle = False
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
               priority: int = 0, kv_transfer_params: TransferParams | None = None) -> bool:
        """False when the server would refuse the request (prompt and output over max_model_len,
        as its frontend checks): the result is then failed with the server's message, answered
        after the request latency, and the engine never sees it."""
        result = self.results[request_id] = RequestResult(kind, len(prompt), output_len, arrival)
        reaches = arrival + self.latencies.request_s
        try:
            resolve_max_tokens(len(prompt), output_len, self.core.max_model_len)
        except InvalidRequestError as error:
            result.end_time, result.error = reaches, f"400: {error}"
            return False
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
        core_request = EngineCoreRequest(request_id, list(prompt), params, None, reaches, priority,
                                         kv_transfer_params=kv_transfer_params)
        heapq.heappush(self._pending, (reaches, next(self._order), request_id, core_request))
        self.load += 1
        return True

    def next_event(self) -> float | None:
        """When this replica next does something: its next step (now, while it has work), the
        next request reaching its core, or the next message reaching its KV connector; None
        when it has none of these."""
        if self.core.has_unfinished_requests() and not self._idle:
            return self.clock.now
        if self._idle and self._wake is not None:  # turning: requests and messages are taken at the next turn
            return self._wake
        events = [self._pending[0][0]] if self._pending else []
        if self.connector is not None and (arrival := self.connector.next_arrival()) is not None:
            events.append(arrival)
        return max(self.clock.now, min(events)) if events else None

    def advance(self) -> list[str]:
        """Move to the next event, take in the requests that reached the core, run one step;
        the ids that finished in it."""
        if (when := self.next_event()) is not None:
            self.clock.advance_to(when)
        self._idle = False
        added, finished = 0, []
        while self._pending and self._pending[0][0] <= self.clock.now:
            self.core.add_request(heapq.heappop(self._pending)[3])
            added += 1
        step = self.core.step()
        if step is not None:
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
        if step is not None:  # (a step that ran nothing but reported connector progress: turn again at once)
            self._idle_s = 0.0
            if step.record is not None:
                self.clock.advance(self.timer.gap_seconds())
        elif self.core.has_unfinished_requests() and not added:
            self._turn_idle()
        return finished

    def _turn_idle(self) -> None:
        """The step ran nothing. An engine whose requests only wait for KV from another instance
        (or hold blocks for one) sleeps until a message or a request comes; otherwise it loops
        until the scheduler lets something through (the prefill-wait guard): time moves a turn."""
        scheduler = self.core.scheduler
        self._idle = True
        if not scheduler.running and len(scheduler.waiting) == scheduler.remote_kv.num_loading:
            self._wake = None
            return
        self._idle_s += self.timer.idle_seconds()
        self._wake = self.clock.now + self.timer.idle_seconds()
        if self._idle_s > MAX_IDLE_S:
            raise RuntimeError(f"the simulated engine scheduled nothing for {MAX_IDLE_S:.0f} simulated seconds "
                               f"while holding {len(self.core.unfinished_request_ids())} request(s)")

"""The simulator is the engine: replaying a real run's step times, the simulated engine makes
every scheduling decision the real one made (the same `SchedulerOutput`, step by step)."""

from __future__ import annotations

import time

from chunkserve.config.engine import EngineArgs
from chunkserve.engine.core import EngineCore
from chunkserve.engine.messages import EngineCoreRequest
from chunkserve.sampling_params import SamplingParams
from chunkserve.sim.simulator import simulate
from chunkserve.sim.trace import SimRequest
from tests.sim.support import fields_that_differ

# (step after which it arrives, prompt length, output tokens, shares the first request's prompt)
ARRIVALS = [(0, 150, 12, False), (0, 40, 30, False), (0, 90, 20, False), (3, 200, 8, False), (3, 30, 25, True),
            (10, 120, 16, True), (10, 60, 40, False), (11, 250, 6, False), (25, 70, 10, True)]


def prompt_of(index: int, length: int, shared: bool) -> list[int]:
    base = [1000 + (7 * i) % 4000 for i in range(150)] if shared else []
    return (base + [2000 + (index * 131 + 17 * i) % 9000 for i in range(length)])[: max(length, len(base))]


def test_a_replay_of_a_real_run_makes_every_scheduling_decision_the_real_engine_made(tiny_gguf):
    """A real engine (the tiny model, the host's clock; KV tight enough to preempt) serves requests
    arriving in waves between steps; the simulator, given its step records and the arrival
    times, schedules exactly what it scheduled."""
    args = EngineArgs(model=tiny_gguf, dtype="float32", max_num_batched_tokens=64, max_num_seqs=5,
                      num_kv_blocks=40, max_model_len=512)
    core = EngineCore(args)
    real_steps = []
    run = core.executor.execute_model
    core.executor.execute_model = lambda output: real_steps.append(output) or run(output)
    requests: list[SimRequest] = []
    arrival_times = []
    try:
        step = 0
        while len(requests) < len(ARRIVALS) or core.has_unfinished_requests():
            for index, (after, length, output_len, shared) in enumerate(ARRIVALS):
                if after == step and index >= len(requests):
                    prompt = prompt_of(index, length, shared)
                    arrival_times.append(time.time())
                    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
                    core.add_request(EngineCoreRequest(f"{index}-0", prompt, params, None, arrival_times[-1]))
                    requests.append(SimRequest(tuple(prompt), output_len, 0.0))
            core.step()
            step += 1
        records = [record.to_dict() for record in core.step_records]
    finally:
        core.shutdown()
    assert any(s.preempted_request_ids for s in real_steps), "the run should exercise preemption"
    assert any(s.prefix_cache_hits for s in real_steps), "the run should exercise the prefix cache"
    start = records[0]["start_time"]
    timed = [SimRequest(r.prompt_token_ids, r.output_len, t - start) for r, t in zip(requests, arrival_times)]
    replay = simulate(timed, args, replay=records, start_time=start, record_steps=True)
    simulated = replay.replicas[0].executor.steps
    assert len(simulated) == len(real_steps)
    for index, (got, expected) in enumerate(zip(simulated, real_steps)):
        assert got == expected, (index, fields_that_differ(got, expected))
    assert [r.completion_tokens for r in replay.results] == [a[2] for a in ARRIVALS]

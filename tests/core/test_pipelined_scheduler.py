"""The scheduler with steps in flight (pipeline parallelism): counts advance when scheduled,
a request waiting for its sampled token is never scheduled twice, a prompt's next chunk rides
the next step, and voided, preempted or aborted work is undone. The fake runner of
test_scheduler.py checks every sampled position's KV; here it runs each step when it is
handed out (the stages run steps in order) and takes the requests' tokens only from the
steps, as the ranks of a multiprocess executor do."""

from __future__ import annotations

import random
from collections import deque

from chunkserve.core.messages import ModelRunnerOutput, SchedulerOutput
from chunkserve.core.sched.scheduler import Scheduler
from tests.core.support import (
    FakeRunner,
    assert_pool_free,
    make_request,
    make_scheduler,
    run,
)


class TokensFromStepsRunner(FakeRunner):
    """Forgets what it sampled: a request's next tokens must come with its next step."""

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for s in output.scheduled:
            if s.new_token_ids:
                tokens = self.tokens[s.request_id]
                del tokens[s.token_ids_from:]
                tokens.extend(s.new_token_ids)
        result = super().execute(output)
        for request_id, accepted in result.sampled_token_ids.items():
            del self.tokens[request_id][-len(accepted):]
        return result


def run_pipelined(scheduler: Scheduler, requests, depth: int, on_step=None, max_steps: int = 20_000,
                  runner: TokensFromStepsRunner | None = None):
    runner = runner or TokensFromStepsRunner(scheduler.config.block_size)
    for request in requests:
        scheduler.add_request(request)
    in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests() and not in_flight:
            break
        while len(in_flight) < depth:
            output = scheduler.schedule()
            if output.is_empty:
                if in_flight:
                    scheduler.void_step(output)
                    break
            if on_step:
                on_step(output, [o for o, _ in in_flight])
            in_flight.append((output, runner.execute(output)))
            if output.is_empty:
                break
        output, result = in_flight.popleft()
        scheduler.update_from_output(output, result)
    assert not scheduler.has_unfinished_requests() and not in_flight, "requests never finished"
    assert_pool_free(scheduler)
    return {r.request_id: r.output_token_ids for r in requests}


def workload(seed: int, n: int = 24):
    rng = random.Random(seed)
    return [(f"r{i}", rng.randint(1, 90), rng.randint(1, 20)) for i in range(n)]


def fresh(spec):
    return [make_request(rid, prompt_len, max_tokens) for rid, prompt_len, max_tokens in spec]


def test_pipelined_outputs_equal_one_step_at_a_time_under_chunking_and_preemption():
    for seed, num_blocks in [(0, 1000), (1, 40), (2, 30)]:
        spec = workload(seed)
        expected = run(make_scheduler(num_blocks=num_blocks), fresh(spec))
        for depth in (2, 3):
            scheduler = make_scheduler(num_blocks=num_blocks, max_steps_in_flight=depth, tokens_from_steps=True)
            assert run_pipelined(scheduler, fresh(spec), depth) == expected
            if num_blocks < 100:
                assert scheduler.num_preemptions > 0, "the small pool was meant to preempt"


def test_no_request_waits_on_its_token_in_two_steps_and_chunks_ride_consecutive_steps():
    steps: list[list[str]] = []

    def on_step(output: SchedulerOutput, in_flight: list[SchedulerOutput]):
        sampling_in_flight = {s.request_id for o in in_flight for s in o.scheduled if s.sample}
        assert not sampling_in_flight & {s.request_id for s in output.scheduled}, (
            "a request was scheduled again before its sampled token came back")
        steps.append([s.request_id for s in output.scheduled])

    requests = fresh([(f"d{i}", 5, 30) for i in range(3)]) + fresh([("long", 200, 2)])
    run_pipelined(make_scheduler(max_num_batched_tokens=32, max_steps_in_flight=2, tokens_from_steps=True),
                  requests, 2, on_step)
    with_long = [i for i, ids in enumerate(steps) if "long" in ids]
    chunk_steps = with_long[:-1]  # the last one samples; the token comes back before its next step
    assert len(chunk_steps) >= 200 // 32
    assert chunk_steps == list(range(chunk_steps[0], chunk_steps[0] + len(chunk_steps))), (
        f"the long prompt's chunks skipped micro-batches: {chunk_steps}")


def test_voided_steps_in_flight_roll_back_and_run_again():
    spec = workload(3, 12)
    expected = run(make_scheduler(), fresh(spec))
    scheduler = make_scheduler(max_steps_in_flight=2, tokens_from_steps=True)
    runner = TokensFromStepsRunner()
    requests = fresh(spec)
    for request in requests:
        scheduler.add_request(request)
    for step in range(1, 10_000):
        if not scheduler.has_unfinished_requests():
            break
        before = {r.request_id: r.num_computed_tokens for r in requests}
        first, second = scheduler.schedule(), scheduler.schedule()
        if step % 4 == 0:  # the first fails before any rank ran it: both are voided, newest first
            scheduler.void_step(second)
            scheduler.void_step(first)
            assert {r.request_id: r.num_computed_tokens for r in requests} == before
            continue
        results = [runner.execute(first), runner.execute(second)]
        scheduler.update_from_output(first, results[0])
        scheduler.update_from_output(second, results[1])
    assert {r.request_id: r.output_token_ids for r in requests} == expected
    assert_pool_free(scheduler)


def test_abort_and_preemption_with_steps_in_flight_return_every_block():
    scheduler = make_scheduler(num_blocks=30, max_steps_in_flight=2, tokens_from_steps=True)
    runner = TokensFromStepsRunner()
    requests = fresh(workload(4, 10))
    for request in requests:
        scheduler.add_request(request)
    in_flight = deque()
    for index in range(400):
        if not scheduler.has_unfinished_requests() and not in_flight:
            break
        output = scheduler.schedule()
        in_flight.append((output, runner.execute(output)))
        if index == 5:
            scheduler.finish_requests([requests[0].request_id, requests[1].request_id],
                                      requests[0].status.FINISHED_ABORTED)
        if len(in_flight) == 2 or output.is_empty:
            done, result = in_flight.popleft()
            scheduler.update_from_output(done, result)
    while in_flight:
        done, result = in_flight.popleft()
        scheduler.update_from_output(done, result)
    assert not scheduler.has_unfinished_requests()
    assert_pool_free(scheduler)
    assert all(r.num_output_tokens == r.max_tokens for r in requests[2:])


def test_a_reused_request_id_ignores_the_old_requests_step_in_flight():
    scheduler = make_scheduler(max_steps_in_flight=2, tokens_from_steps=True)
    runner = TokensFromStepsRunner()
    old = make_request("a", 40, max_tokens=4)
    scheduler.add_request(old)
    first = scheduler.schedule()  # a's first chunk (32 tokens), in flight
    result = runner.execute(first)
    scheduler.finish_requests(["a"], old.status.FINISHED_ABORTED)
    new = make_request("a", 6, max_tokens=3)
    scheduler.add_request(new)
    scheduler.update_from_output(first, result)  # the old a's: not the new one's
    assert new.num_computed_tokens == 0 and new.num_output_tokens == 0
    assert run_pipelined(scheduler, [], 2, runner=runner) == {}
    assert new.num_output_tokens == 3

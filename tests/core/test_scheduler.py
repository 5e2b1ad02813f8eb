"""Scheduler tests without a model: a fake runner that simulates the paged KV cache.

The fake runner writes (position, the token history up to it) into every slot the step
computes, as a real KV entry depends on the whole prefix, and before sampling checks that the
request's whole history is in its blocks (written by it or, through the prefix cache, by an
earlier request with the same prefix). Its "model" is
a deterministic function of the token history, so a request's output only stays the same
under preemption if the scheduler recomputed exactly the right tokens.
"""

from __future__ import annotations

import random

import pytest

from chunkserve.core.request import RequestStatus
from chunkserve.sampling_params import SamplingParams
from tests.core.support import (
    BLOCK,
    EOS,
    FakeRunner,
    assert_pool_free,
    make_request,
    make_scheduler,
    run,
)


def test_budget_is_never_exceeded_and_all_finish():
    random.seed(0)
    requests = [make_request(f"r{i}", random.randint(1, 90), random.randint(1, 20)) for i in range(40)]
    outputs = run(make_scheduler(), requests)
    assert all(len(outputs[r.request_id]) == r.sampling_params.max_tokens for r in requests)
    assert all(r.status == RequestStatus.FINISHED_LENGTH for r in requests)


def test_running_decodes_are_scheduled_every_step_during_a_long_prefill():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    decoders = [make_request(f"d{i}", 3, max_tokens=60) for i in range(4)]
    long_prompt = make_request("long", 200, max_tokens=2)
    runner = FakeRunner()
    for request in decoders:
        scheduler.add_request(request)
    for _ in range(3):
        output = scheduler.schedule()
        scheduler.update_from_output(output, runner.execute(output))
    scheduler.add_request(long_prompt)
    prefill_steps = 0
    while long_prompt.num_output_tokens == 0:
        decoding = {r.request_id for r in scheduler.running if r.is_decoding}
        output = scheduler.schedule()
        scheduled = {s.request_id: s for s in output.scheduled}
        assert decoding <= scheduled.keys(), "a running decode was stalled"
        if "long" in scheduled:
            prefill_steps += 1
            assert output.forward_mode.value == "MIXED"
        scheduler.update_from_output(output, runner.execute(output))
    assert prefill_steps >= 200 // 16


@pytest.mark.parametrize("budget", [8, 13, 32])
def test_chunks_end_on_block_boundaries(budget):
    """Unless no boundary lay within the step's room: then the chunk takes the rest of the
    budget without crossing one (chunking.py: alignment never starves a prompt)."""
    def check(scheduler, output):
        step_tokens = sum(s.num_scheduled_tokens for s in output.scheduled)
        for s in output.scheduled:
            start, end = s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens
            if not s.sample and end % BLOCK:
                assert step_tokens == budget and end // BLOCK == start // BLOCK, \
                    f"chunk ends at {end}, not a block boundary, with room in the step"

    random.seed(1)
    run(make_scheduler(max_num_batched_tokens=budget, max_num_seqs=8),
        [make_request(f"r{i}", random.randint(5, 70)) for i in range(12)], check)


def test_chunked_prefill_off_prefills_each_prompt_whole():
    def check(scheduler, output):
        for s in output.scheduled:
            assert s.num_computed_tokens == 0 or s.num_scheduled_tokens == 1

    run(make_scheduler(max_num_batched_tokens=100, enable_chunked_prefill=False),
        [make_request(f"r{i}", 30 + i) for i in range(8)], check)


def test_mixing_off_never_mixes():
    modes = set()
    run(make_scheduler(enable_mixed_batch=False),
        [make_request(f"r{i}", 10 + 7 * i, max_tokens=10) for i in range(10)],
        lambda s, o: modes.add(o.forward_mode.value))
    assert "MIXED" not in modes and {"EXTEND", "DECODE"} <= modes


def test_long_prefill_token_threshold_caps_a_request_per_step():
    def check(scheduler, output):
        assert all(s.num_scheduled_tokens <= 8 for s in output.scheduled)

    run(make_scheduler(long_prefill_token_threshold=8), [make_request("r", 50)], check)


def test_max_num_partial_prefills_limits_unfinished_prompts():
    def check(scheduler, output):
        partial = [s for s in output.scheduled if not s.sample and not s.is_decode]
        assert len(partial) <= 2

    run(make_scheduler(max_num_batched_tokens=64, max_num_partial_prefills=2),
        [make_request(f"r{i}", 100) for i in range(6)], check)


def test_preemption_under_a_tiny_pool_keeps_every_output():
    random.seed(2)
    specs = [(f"r{i}", random.randint(1, 30), random.randint(5, 30)) for i in range(12)]
    big = run(make_scheduler(num_blocks=1000), [make_request(*spec) for spec in specs])
    small_scheduler = make_scheduler(num_blocks=20)
    small = run(small_scheduler, [make_request(*spec) for spec in specs])
    assert small_scheduler.num_preemptions > 0, "the pool was not small enough to preempt"
    assert small == big


def test_priority_policy_admits_and_preempts_by_priority():
    scheduler = make_scheduler(num_blocks=1000, scheduling_policy="priority", max_num_seqs=1)
    requests = [make_request("low", 5, 3, priority=5, arrival=0), make_request("high", 5, 3, priority=0, arrival=1),
                make_request("mid", 5, 3, priority=2, arrival=2)]
    finish_order = []

    def check(scheduler, output):
        for s in output.scheduled:
            if s.request_id not in finish_order:
                finish_order.append(s.request_id)

    run(scheduler, requests, check)
    assert finish_order == ["high", "mid", "low"]


def test_priority_preemption_picks_the_lowest_priority():
    scheduler = make_scheduler(num_blocks=6, scheduling_policy="priority", max_num_batched_tokens=16)
    important = make_request("important", 8, max_tokens=12, priority=0, arrival=1)
    unimportant = make_request("unimportant", 8, max_tokens=12, priority=9, arrival=0)
    run(scheduler, [unimportant, important])
    assert important.num_preemptions == 0 and unimportant.num_preemptions > 0


def test_fcfs_preempts_the_most_recently_admitted():
    scheduler = make_scheduler(num_blocks=6, max_num_batched_tokens=16)
    first, second = make_request("first", 8, max_tokens=12), make_request("second", 8, max_tokens=12)
    run(scheduler, [first, second])
    assert first.num_preemptions == 0 and second.num_preemptions > 0


@pytest.mark.parametrize("abort_after", [0, 1, 3, 7, 15])
def test_abort_at_any_point_frees_all_blocks(abort_after):
    scheduler = make_scheduler(max_num_batched_tokens=16)
    runner = FakeRunner()
    requests = [make_request(f"r{i}", 20 + 10 * i, max_tokens=20) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    for _ in range(abort_after):
        output = scheduler.schedule()
        scheduler.update_from_output(output, runner.execute(output))
    aborted = scheduler.finish_requests([r.request_id for r in requests], RequestStatus.FINISHED_ABORTED)
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in aborted)
    assert not scheduler.has_unfinished_requests()
    assert_pool_free(scheduler)
    assert scheduler.schedule().finished_request_ids <= {r.request_id for r in requests}


def test_abort_one_request_leaves_the_others_running():
    scheduler = make_scheduler()
    runner = FakeRunner()
    keep, drop = make_request("keep", 10, 5), make_request("drop", 10, 5)
    scheduler.add_request(keep)
    scheduler.add_request(drop)
    output = scheduler.schedule()
    scheduler.update_from_output(output, runner.execute(output))
    scheduler.finish_requests(["drop"], RequestStatus.FINISHED_ABORTED)
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        assert "drop" not in {s.request_id for s in output.scheduled}
        scheduler.update_from_output(output, runner.execute(output))
    assert keep.num_output_tokens == 5 and drop.status == RequestStatus.FINISHED_ABORTED
    assert_pool_free(scheduler)


def test_stop_token_and_eos_finish_with_stop():
    scheduler = make_scheduler()
    runner = FakeRunner()
    request = make_request("r", 5, max_tokens=50)
    request.sampling_params = SamplingParams(max_tokens=50, min_tokens=2)
    scheduler.add_request(request)
    output = scheduler.schedule()
    runner_output = runner.execute(output)
    runner_output.sampled_token_ids["r"] = [EOS]  # EOS before min_tokens: ignored
    scheduler.update_from_output(output, runner_output)
    assert not request.is_finished
    output = scheduler.schedule()
    runner_output = runner.execute(output)
    runner_output.sampled_token_ids["r"] = [EOS]
    scheduler.update_from_output(output, runner_output)
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert_pool_free(scheduler)


def test_requests_that_each_need_almost_the_whole_pool_do_not_thrash():
    """Three requests each needing 63 of a 64-block pool: the hostile case that preempted 100
    times. A preempted request comes back only when it can run to its end, so each request is
    preempted at most once and every output is the one an ample pool gives."""
    specs = [(f"big{i}", 4 * 40, 4 * 23 - 1) for i in range(3)]  # prompt + max_tokens = 63 blocks of 4
    ample = run(make_scheduler(num_blocks=1000, max_num_batched_tokens=64), [make_request(*s) for s in specs])
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=64, max_model_len=4 * 64)
    tight = run(scheduler, [make_request(*s) for s in specs])
    assert tight == ample
    assert scheduler.num_preemptions <= len(specs)


def test_only_the_requests_the_engine_allows_run_and_the_rest_keep_their_place():
    scheduler = make_scheduler(num_blocks=1000)
    requests = [make_request(f"r{i}", 6, max_tokens=4) for i in range(4)]
    runner = FakeRunner()
    for request in requests:
        scheduler.add_request(request)
    scheduler.restrict_to({"r1", "r3"})
    for _ in range(6):
        output = scheduler.schedule()
        assert {s.request_id for s in output.scheduled} <= {"r1", "r3"}
        scheduler.update_from_output(output, runner.execute(output))
    assert requests[0].num_computed_tokens == 0 and requests[2].num_computed_tokens == 0
    scheduler.restrict_to(None)
    assert run(scheduler, [], runner=runner) == {}
    assert all(r.is_finished for r in requests)

"""The scheduler's chunk policies (chunking.py, step_predictor.py) with the fake runner of
test_scheduler.py: alignment, the decreasing schedule, the TBT-SLO budget and its starvation
guard, the TTFT SLO's order, and the partial-prefill limits between long and short prompts."""

from __future__ import annotations

import random

import numpy as np
import pytest

from chunkserve.config.scheduler import ChunkSchedule
from chunkserve.core.step_predictor import StepShape, StepTimePredictor
from tests.core.support import BLOCK, FakeRunner, make_request, make_scheduler, run


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def known_predictor(constant_ms: float, ms_per_row: float) -> StepTimePredictor:
    """A step-time model with given coefficients: `constant_ms` + `ms_per_row` per row."""
    predictor = StepTimePredictor()
    per_1k_rows = ms_per_row  # seconds per 1k rows = ms per row
    predictor.coefficients = np.array([constant_ms / 1e3, per_1k_rows, per_1k_rows, 0.0, 0.0, 0.0, 0.0, 0.0])
    return predictor


def step_once(scheduler, runner):
    output = scheduler.schedule()
    scheduler.update_from_output(output, runner.execute(output))
    return output


def cut_chunks(output):
    """(rows in the step before the chunk, chunk) for every chunk that leaves its prompt unfinished."""
    rows, cuts = 0, []
    for s in output.scheduled:
        if not s.sample and not s.is_decode:
            cuts.append((rows, s))
        rows += s.num_scheduled_tokens
    return cuts


@pytest.mark.parametrize("align, budget", [(4, 30), (8, 32), (16, 50), (16, 64)])
def test_every_cut_chunk_is_aligned(align, budget):
    """Aligned, except where no block boundary lay within the step's room: that chunk takes the
    rest of the budget, cut at any token, and the prompt's next chunk ends on a boundary."""
    seen_step_alignment = []

    def check(scheduler, output):
        for rows_before, s in cut_chunks(output):
            start, n = s.num_computed_tokens, s.num_scheduled_tokens
            if (start + n) % BLOCK:
                assert rows_before + n == budget and (start + n) // BLOCK == start // BLOCK
                continue
            if start % BLOCK:
                continue  # back onto a boundary after such a chunk
            assert n % BLOCK == 0
            step_aligned = (rows_before + n) % align == 0
            assert n % align == 0 or step_aligned or n == BLOCK, f"chunk {n} after {rows_before} rows"
            seen_step_alignment.append(step_aligned and rows_before % align != 0)

    random.seed(3)
    requests = [make_request(f"r{i}", random.randint(1, 150), random.randint(1, 12)) for i in range(30)]
    run(make_scheduler(max_num_batched_tokens=budget, max_num_seqs=8, chunk_align=align,
                       max_num_partial_prefills=2), requests, check)
    if align > BLOCK:
        assert any(seen_step_alignment), "no chunk was shortened to align the whole step"


def test_a_budget_of_one_block_admits_prompts_beside_decodes():
    """At a budget of one block, a block-aligned chunk never fits beside a decode row: cut at
    any token instead, prompts keep being admitted while others decode (the engine once ran at
    most two requests at once this way under load), and every request finishes."""
    scheduler = make_scheduler(max_num_batched_tokens=BLOCK, max_num_seqs=16)
    running_at_once = []
    requests = [make_request(f"r{i}", 3 * BLOCK + 1, max_tokens=20) for i in range(8)]
    outputs = run(scheduler, requests, lambda s, o: running_at_once.append(len(o.scheduled)))
    assert max(running_at_once) == BLOCK  # a step of one decode per row: the budget, all in use
    assert all(len(tokens) == 20 for tokens in outputs.values())


def test_decreasing_schedule_chunks_of_a_known_prompt():
    scheduler = make_scheduler(max_num_batched_tokens=64, chunk_schedule=ChunkSchedule.parse("32:8:4:64"))
    chunks = []
    run(scheduler, [make_request("r", 100, max_tokens=1)],
        lambda s, o: chunks.extend(x.num_scheduled_tokens for x in o.scheduled))
    # stages of 16 tokens: 32 tokens while < 16 done, 24 while < 32, 16 while < 48, then 8
    assert chunks == [32, 16, 8, 8, 8, 8, 8, 8, 4]


def decodes_then_a_long_prompt(scheduler, num_decodes: int, long_len: int):
    """Start `num_decodes` one-token prompts, then schedule the step that adds a long prompt."""
    runner = FakeRunner()
    for i in range(num_decodes):
        scheduler.add_request(make_request(f"d{i}", 1, max_tokens=50))
    step_once(scheduler, runner)
    scheduler.add_request(make_request("long", long_len))
    return step_once(scheduler, runner)


def test_decreasing_schedule_counts_the_decodes_in_the_step():
    output = decodes_then_a_long_prompt(make_scheduler(chunk_schedule=ChunkSchedule.parse("16:16:1:16")), 4, 100)
    assert output.num_decode_tokens == 4 and output.num_prefill_tokens == 12


def test_slo_budget_never_schedules_a_step_predicted_over_the_slo():
    predictor = known_predictor(constant_ms=10, ms_per_row=1)
    clock = Clock()
    scheduler = make_scheduler(max_num_batched_tokens=64, predictor=predictor, clock=clock, tbt_slo_ms=40,
                               max_prefill_wait_ms=10_000)
    runner = FakeRunner()
    random.seed(4)
    requests = [make_request(f"r{i}", random.randint(1, 120), random.randint(1, 30)) for i in range(20)]
    for request in requests:
        scheduler.add_request(request)
    prefill_steps = 0
    while scheduler.has_unfinished_requests():
        output = step_once(scheduler, runner)
        clock.now += 0.01
        assert output.predicted_duration_s == pytest.approx(predictor.predict(StepShape.of(output.scheduled)))
        if output.num_prefill_tokens:
            prefill_steps += 1
            assert output.predicted_duration_s <= 0.040 and not output.prefill_wait_guard
    assert prefill_steps and scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    assert [r.num_output_tokens for r in requests] == [r.max_tokens for r in requests]


def test_slo_budget_fills_the_step_up_to_the_slo():
    scheduler = make_scheduler(max_num_batched_tokens=64, predictor=known_predictor(10, 1), tbt_slo_ms=40)
    output = decodes_then_a_long_prompt(scheduler, 8, 200)
    # 10 ms + 8 decodes = 18 ms: room for 22 rows, whole blocks of 4: 20 (28 rows = 38 ms)
    assert output.num_decode_tokens == 8 and output.num_prefill_tokens == 20


def test_starvation_guard_fires_exactly_when_the_wait_exceeds_its_limit():
    clock = Clock()
    predictor = StepTimePredictor()  # no model yet: no SLO
    scheduler = make_scheduler(predictor=predictor, clock=clock, tbt_slo_ms=15, max_prefill_wait_ms=125)
    runner = FakeRunner()
    for i in range(8):
        scheduler.add_request(make_request(f"d{i}", 1, max_tokens=500))
    step_once(scheduler, runner)
    predictor.coefficients = known_predictor(10, 1).coefficients  # 8 decodes alone: 18 ms > 15 ms
    scheduler.add_request(make_request("long", 40, arrival=1.0))
    tick = 2**-10  # times in binary fractions of a second, so the comparisons are exact
    guarded_at = []
    for now in (0, 0.0625, 0.125, 0.125 + tick, 0.125 + 2 * tick, 0.25 + tick, 0.25 + 2 * tick, 0.375 + 3 * tick):
        clock.now = 1.0 + now
        output = step_once(scheduler, runner)
        assert output.num_decode_tokens == 8
        if output.num_prefill_tokens:
            assert output.prefill_wait_guard and output.num_prefill_tokens == BLOCK
            guarded_at.append(now)
        else:
            assert not output.prefill_wait_guard
    assert guarded_at == [0.125 + tick, 0.25 + 2 * tick, 0.375 + 3 * tick]


def test_a_stream_of_short_prompts_never_keeps_a_long_one_past_the_guard():
    clock = Clock()
    scheduler = make_scheduler(num_blocks=5000, max_num_seqs=64, predictor=known_predictor(10, 1), clock=clock,
                               tbt_slo_ms=30, max_prefill_wait_ms=200, max_num_partial_prefills=4,
                               max_long_partial_prefills=4)
    runner = FakeRunner()
    for i in range(16):  # 26 ms of decodes: room for one block a step at most
        scheduler.add_request(make_request(f"d{i}", 1, max_tokens=400))
    step_once(scheduler, runner)
    long_prompt = make_request("long", 120, max_tokens=1, arrival=0.0)
    scheduler.add_request(long_prompt)
    last_progress, gaps = 0.0, []
    for step in range(400):
        clock.now = step * 0.01
        if step % 2 == 0:
            scheduler.add_request(make_request(f"s{step}", 4, max_tokens=1, arrival=clock.now))
        before = long_prompt.num_computed_tokens
        step_once(scheduler, runner)
        if long_prompt.num_computed_tokens > before:
            gaps.append(clock.now - last_progress)
            last_progress = clock.now
        if long_prompt.num_output_tokens:
            break
    assert long_prompt.num_output_tokens == 1, "the long prompt starved"
    assert max(gaps) <= 0.200 + 0.01 + 1e-9


def test_short_prompts_pass_a_long_prefill_within_the_partial_prefill_limits():
    scheduler = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=16,
                               max_num_partial_prefills=2, max_long_partial_prefills=1)
    runner = FakeRunner()
    scheduler.add_request(make_request("long1", 400, max_tokens=1))
    scheduler.add_request(make_request("long2", 400, max_tokens=1))
    step_once(scheduler, runner)
    for i in range(10):
        short = make_request(f"s{i}", 8, max_tokens=2)
        scheduler.add_request(short)
        output = step_once(scheduler, runner)
        scheduled = {s.request_id: s.num_scheduled_tokens for s in output.scheduled}
        assert scheduled["long1"] == 16 and "long2" not in scheduled, "one long prompt at a time"
        assert short.num_output_tokens == 1, "a short prompt waited behind the long ones"


def test_without_a_threshold_the_long_prefill_takes_the_whole_budget():
    scheduler = make_scheduler(max_num_batched_tokens=32)
    runner = FakeRunner()
    scheduler.add_request(make_request("long", 400, max_tokens=1))
    step_once(scheduler, runner)
    short = make_request("short", 8, max_tokens=2)
    scheduler.add_request(short)
    step_once(scheduler, runner)
    assert short.num_output_tokens == 0


def test_ttft_slo_serves_prompts_that_can_still_make_it_first():
    clock = Clock()
    scheduler = make_scheduler(max_num_batched_tokens=32, predictor=known_predictor(10, 1), clock=clock,
                               ttft_slo_ms=100)
    runner = FakeRunner()
    scheduler.add_request(make_request("long", 400, max_tokens=1, arrival=0.0))  # ~410 ms: hopeless
    step_once(scheduler, runner)
    clock.now = 0.01
    short = make_request("short", 12, max_tokens=2, arrival=0.01)
    scheduler.add_request(short)
    output = step_once(scheduler, runner)
    assert output.scheduled[0].request_id == "short" and short.num_output_tokens == 1
    assert {s.request_id: s.num_scheduled_tokens for s in output.scheduled}["long"] == 20


def test_outputs_are_unchanged_under_every_policy():
    random.seed(5)
    specs = [(f"r{i}", random.randint(1, 150), random.randint(1, 20)) for i in range(24)]
    expected = run(make_scheduler(), [make_request(*spec) for spec in specs])
    clock = Clock()
    policies = [
        dict(chunk_align=16),
        dict(chunk_schedule=ChunkSchedule.parse("32:8:3:90")),
        dict(predictor=known_predictor(5, 1), clock=clock, tbt_slo_ms=25, max_prefill_wait_ms=30),
        dict(predictor=known_predictor(5, 1), clock=clock, ttft_slo_ms=50, long_prefill_token_threshold=16,
             max_num_partial_prefills=3, max_long_partial_prefills=2),
    ]
    for policy in policies:
        def tick(scheduler, output):
            clock.now += 0.01
        assert run(make_scheduler(**policy), [make_request(*spec) for spec in specs], tick) == expected

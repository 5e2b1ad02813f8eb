"""Steps that give a decode several tokens: draft tokens verified in one step (the seam
speculative decoding lands on), driven by the fake runner, which drafts 0-4 tokens per decode
and accepts a random run of them. Whatever is accepted, the outputs, the KV of every position
and the block accounting must be those of plain one-token decoding."""

from __future__ import annotations

import random

import pytest

from chunkserve.core.request import RequestStatus
from chunkserve.sampling_params import SamplingParams
from tests.core.support import (
    EOS,
    FakeRunner,
    assert_references_match_tables,
    make_request,
    make_scheduler,
    run,
)


def workload(seed: int, shared_prefix: bool = False) -> list:
    rng = random.Random(seed)
    requests = [make_request(f"r{i}", rng.randint(1, 40), rng.randint(1, 30)) for i in range(16)]
    if shared_prefix:  # later requests repeat earlier prompts: their blocks come from the prefix cache
        for i, request in enumerate(requests[8:]):
            request.prompt_token_ids = list(requests[i].prompt_token_ids) + [7] * (i % 5)
    return requests


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("config", [
    dict(),
    dict(num_blocks=30),  # preemptions: pending drafts are dropped, the request recomputed
    dict(max_num_batched_tokens=8, max_num_seqs=8),  # drafts trimmed to the budget
    dict(shared_prefix=True),
])
def test_accepted_runs_of_any_length_give_the_one_token_outputs(seed, config):
    config = dict(config)
    shared = config.pop("shared_prefix", False)
    plain = run(make_scheduler(**config), workload(seed, shared))
    scheduler = make_scheduler(**config)
    runner = FakeRunner(speculate=True, seed=seed)
    lengths = []

    def check(scheduler, output):
        assert_references_match_tables(scheduler, output)
        for s in output.scheduled:
            assert not s.draft_token_ids or s.is_decode, "drafts only after the prompt"
            lengths.append(len(s.draft_token_ids))

    speculative = run(scheduler, workload(seed, shared), check, runner=runner)
    assert speculative == plain
    assert 0 < runner.num_accepted < runner.num_drafted, "the runs should mix accepted and rejected drafts"
    assert max(lengths) > 1


def test_prefix_cache_registers_only_verified_blocks():
    """A request's later twin reuses its cached blocks; the fake runner checks their KV, so a
    block cached with a rejected draft's KV in it would fail the twin's sampling check."""
    scheduler = make_scheduler()
    runner = FakeRunner(speculate=True, draft_accuracy=0.3)
    first = make_request("first", 9, max_tokens=30)
    run(scheduler, [first], runner=runner)
    twin = make_request("twin", 9, max_tokens=30)
    twin.prompt_token_ids = first.prompt_token_ids + first.output_token_ids[:20]
    run(scheduler, [twin], runner=runner)
    assert twin.num_cached_tokens == 28  # 7 full blocks of 4: prompt and verified output alike


def test_a_stop_token_inside_an_accepted_run_ends_it_there():
    probe = make_request("r", 6, max_tokens=12)
    tokens = run(make_scheduler(), [probe])["r"]
    stop = tokens[4]

    def stopping():
        request = make_request("r", 6, max_tokens=12)
        request.sampling_params = SamplingParams(max_tokens=12, stop_token_ids=[stop])
        return request

    plain, spec = stopping(), stopping()
    run(make_scheduler(), [plain])
    run(make_scheduler(), [spec], runner=FakeRunner(speculate=True, draft_accuracy=1.0))
    assert spec.output_token_ids == plain.output_token_ids == tokens[: tokens.index(stop) + 1]
    assert spec.status == plain.status == RequestStatus.FINISHED_STOPPED and spec.stop_reason == stop


def test_drafts_never_reach_past_max_tokens():
    def check(scheduler, output):
        for s in output.scheduled:
            request = scheduler.requests[s.request_id]
            assert request.num_output_tokens + len(s.draft_token_ids) < request.max_tokens

    requests = [make_request(f"r{i}", 5, max_tokens=3 + i) for i in range(6)]
    run(make_scheduler(), requests, check, runner=FakeRunner(speculate=True, draft_accuracy=1.0))
    assert [r.num_output_tokens for r in requests] == [3 + i for i in range(6)]
    assert EOS not in {t for r in requests for t in r.output_token_ids}


def test_drafts_never_push_another_decode_out_of_its_step():
    """Every running decode gets its token in every step (the budget holds max_num_seqs);
    drafts get only what is left beside them."""
    scheduler = make_scheduler(max_num_batched_tokens=2, max_num_seqs=2)
    runner = FakeRunner()
    a, b = make_request("a", 1, 20), make_request("b", 1, 20)
    for request in (a, b):
        scheduler.add_request(request)
    while not (a.is_decoding and b.is_decoding):
        output = scheduler.schedule()
        scheduler.update_from_output(output, runner.execute(output))
    a.spec_token_ids = [5, 6, 7]
    output = scheduler.schedule()
    assert {s.request_id: s.num_scheduled_tokens for s in output.scheduled} == {"a": 1, "b": 1}

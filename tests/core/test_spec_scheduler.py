"""Speculative decoding in the scheduler with a real SchedulerConfig: n-gram drafts proposed in
`update_from_output` and verified in the next step (within the budget), none for prompts in
progress, dropped on preemption, the draft policy's state and counts; with a draft model, the
proposals the worker is asked for and the blocks allocated ahead for them.

(tests/core/test_multi_token_steps.py drives the seam with a fake runner that drafts; these
tests drive the scheduler's own proposers.)"""

from __future__ import annotations

import pytest

from chunkserve.config.speculative import SpeculativeConfig
from chunkserve.core.messages import ModelRunnerOutput, SchedulerOutput
from chunkserve.core.request import Request, RequestStatus
from chunkserve.sampling_params import SamplingParams
from tests.core.support import (
    BLOCK,
    EOS,
    FakeRunner,
    fake_model,
    make_request,
    make_scheduler,
    run,
)

K = 3
NGRAM = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
                                 "prompt_lookup_max": 3, "policy": "always"})
DRAFT_MODEL = SpeculativeConfig.parse({"method": "draft_model", "model": "/models/draft",
                                       "num_speculative_tokens": K, "policy": "always"})
PERIOD = 3


def periodic_model(tokens: list[int]) -> int:
    """The periodic runner's "model": it repeats the last PERIOD tokens, so n-gram drafts of
    a periodic request are right."""
    return tokens[-PERIOD]


class PeriodicRunner(FakeRunner):
    """The fake runner (simulated KV, checked before every sample) with the periodic model;
    with `max_accepted`, it accepts at most that many drafts of a run (then a token of its own
    that differs from the next draft)."""

    def __init__(self, max_accepted: int | None = None) -> None:
        super().__init__()
        self.max_accepted = max_accepted

    def verify(self, tokens: list[int], drafts: list[int]) -> list[int]:
        accepted: list[int] = []
        for draft in drafts:
            if draft != periodic_model(tokens + accepted) or len(accepted) == self.max_accepted:
                break
            accepted.append(draft)
        self.num_drafted += len(drafts)
        self.num_accepted += len(accepted)
        own = periodic_model(tokens + accepted)
        if len(accepted) < len(drafts) and own == drafts[len(accepted)]:
            own = own % 997 + 1  # (rejected: the token must differ from the draft)
        return accepted + [own]


def periodic_request(request_id: str, pattern: list[int], repeats: int = 3, max_tokens: int = 20) -> Request:
    return Request(request_id, pattern * repeats, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   eos_token_id=EOS, arrival_time=0.0)


def step(scheduler, runner) -> tuple[SchedulerOutput, dict]:
    output = scheduler.schedule()
    outputs = scheduler.update_from_output(output, runner.execute(output))
    return output, {o.request_id: o.new_token_ids for o in outputs}


def by_id(output: SchedulerOutput) -> dict:
    return {s.request_id: s for s in output.scheduled}


# ----- n-gram drafts ---------------------------------------------------------------------------


def test_ngram_drafts_are_proposed_verified_and_counted():
    scheduler = make_scheduler(speculative=NGRAM)
    runner = PeriodicRunner()
    request = periodic_request("r", [1, 2, 3])
    scheduler.add_request(request)
    assert scheduler.stats().spec_decode.num_drafts == 0
    first, _ = step(scheduler, runner)
    assert by_id(first)["r"].draft_token_ids == []  # the prompt: nothing to verify yet
    assert request.output_token_ids == [1]
    # [.., 1, 2, 3, 1]: the suffix [2, 3, 1] occurred at 4, followed by [2, 3, 1]
    assert request.spec_token_ids == [2, 3, 1]

    output, new_tokens = step(scheduler, runner)
    scheduled = by_id(output)["r"]
    assert scheduled.draft_token_ids == [2, 3, 1] and scheduled.is_decode and scheduled.sample
    assert scheduled.num_scheduled_tokens == output.num_scheduled_tokens == 1 + K  # drafts count in the budget
    assert len(scheduler.kv.block_table("r")) * BLOCK >= 9 + 1 + K
    assert new_tokens == {"r": [2, 3, 1, 2]}  # every draft accepted, then the model's own
    assert request.num_computed_tokens == request.num_tokens - 1
    stats = scheduler.stats().spec_decode
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, K, K)
    assert stats.accepted_per_pos == (1, 1, 1)
    assert request.spec_token_ids == [3, 1, 2]  # proposed again from the new tokens


def test_a_partly_rejected_run_rolls_back_and_is_counted():
    scheduler = make_scheduler(speculative=NGRAM)
    runner = PeriodicRunner(max_accepted=1)
    request = periodic_request("r", [1, 2, 3])
    scheduler.add_request(request)
    step(scheduler, runner)
    output, new_tokens = step(scheduler, runner)
    assert by_id(output)["r"].draft_token_ids == [2, 3, 1]
    assert new_tokens["r"][0] == 2 and len(new_tokens["r"]) == 2 and new_tokens["r"][1] != 3
    assert request.num_computed_tokens == 9 + 1 + 1  # the rejected drafts' positions are not computed
    stats = scheduler.stats().spec_decode
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, K, 1)
    assert stats.accepted_per_pos == (1, 0, 0)


def test_drafts_change_no_output_and_save_steps():
    def workload():
        return [periodic_request(f"p{i}", [10 * i + 1, 10 * i + 2, 10 * i + 3], max_tokens=25) for i in range(4)] + [
            make_request(f"m{i}", 7 + i, max_tokens=12) for i in range(3)]  # these repeat only later

    steps = {}

    def count(name):
        def check(scheduler, output):
            steps[name] = steps.get(name, 0) + 1
        return check

    plain = run(make_scheduler(), workload(), count("plain"), runner=PeriodicRunner())
    runner = PeriodicRunner()
    scheduler = make_scheduler(speculative=NGRAM)
    speculative = run(scheduler, workload(), count("spec"), runner=runner)
    assert speculative == plain
    assert all(tokens[-1] == periodic_model(r.prompt_token_ids + tokens[:-1])
               for r, tokens in zip(workload(), plain.values()))
    assert steps["spec"] < steps["plain"] * 0.6
    stats = scheduler.stats().spec_decode
    assert stats.num_accepted_tokens == runner.num_accepted > 0
    assert stats.num_draft_tokens == runner.num_drafted


def test_drafts_are_trimmed_to_the_budget_beside_every_decode():
    scheduler = make_scheduler(max_num_batched_tokens=6, speculative=NGRAM)
    runner = PeriodicRunner()
    a, b = periodic_request("a", [1, 2, 3], repeats=1), periodic_request("b", [4, 5, 6], repeats=1)
    for request in (a, b):
        scheduler.add_request(request)
    for _ in range(10):  # (both prompts fit the first step; drafts once the outputs repeat them)
        if a.spec_token_ids and b.spec_token_ids:
            break
        step(scheduler, runner)
    assert len(a.spec_token_ids) == len(b.spec_token_ids) == K
    output, _ = step(scheduler, runner)
    scheduled = by_id(output)
    assert output.num_scheduled_tokens == 6
    assert [len(scheduled["a"].draft_token_ids), len(scheduled["b"].draft_token_ids)] == [3, 1]


def test_a_request_in_the_middle_of_its_prompt_gets_no_drafts():
    scheduler = make_scheduler(max_num_batched_tokens=8, speculative=NGRAM)
    runner = PeriodicRunner()
    decoder = periodic_request("d", [1, 2, 3], max_tokens=40)
    scheduler.add_request(decoder)
    while not decoder.spec_token_ids:
        step(scheduler, runner)
    long = periodic_request("long", [7, 8, 9], repeats=10)  # 30 tokens that repeat: chunks of the budget
    scheduler.add_request(long)
    chunks = could_draft = 0
    while long.num_output_tokens == 0:
        output, _ = step(scheduler, runner)
        if "long" in by_id(output):
            chunks += 1
            assert by_id(output)["long"].draft_token_ids == []
        if long.num_output_tokens == 0:
            assert long.spec_token_ids == []
            # (its tokens so far repeat: only the prompt rule keeps drafts away)
            could_draft += bool(scheduler.drafting.ngram.propose(long.prompt_token_ids[:long.num_computed_tokens], 10_000))
        assert by_id(output)["d"].draft_token_ids  # the decode beside it keeps drafting
    assert chunks > 2 and could_draft > 0
    assert long.spec_token_ids  # its prompt done and its first token out: drafts for its first decode


def test_preemption_drops_pending_drafts():
    def workload():
        return [periodic_request(f"r{i}", [10 * i + 1, 10 * i + 2, 10 * i + 3], max_tokens=30) for i in range(4)]

    plain = run(make_scheduler(num_blocks=14), workload(), runner=PeriodicRunner())
    scheduler = make_scheduler(num_blocks=14, speculative=NGRAM)
    runner = PeriodicRunner()  # (a periodic request has drafts pending at every step)
    requests = workload()
    for request in requests:
        scheduler.add_request(request)
    preempted_with_drafts = 0
    while scheduler.has_unfinished_requests():
        pending = {r.request_id: list(r.spec_token_ids) for r in scheduler.running}
        output = scheduler.schedule()
        for request_id in output.preempted_request_ids:
            request = next(r for r in requests if r.request_id == request_id)
            assert request.spec_token_ids == [], "a preempted request kept its drafts"
            assert request_id not in by_id(output)
            preempted_with_drafts += bool(pending.get(request_id))
        scheduler.update_from_output(output, runner.execute(output))
    assert preempted_with_drafts > 0
    assert {r.request_id: r.output_token_ids for r in requests} == plain
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def test_no_spec_decode_stats_without_a_config():
    assert make_scheduler().stats().spec_decode is None
    assert make_scheduler().drafting.policy is None


# ----- the draft policy's state -----------------------------------------------------------------


AUTO = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
                                "prompt_lookup_max": 3})


@pytest.mark.parametrize("end", ["abort", "finish"])
def test_a_request_that_ends_leaves_no_policy_state(end):
    scheduler = make_scheduler(speculative=AUTO)  # auto, no step-time model: drafts while it learns
    runner = PeriodicRunner()
    request = periodic_request("r", [1, 2, 3], max_tokens=8)
    other = periodic_request("o", [4, 5, 6], max_tokens=30)
    for r in (request, other):
        scheduler.add_request(r)
    for _ in range(2):
        step(scheduler, runner)
    policy = scheduler.drafting.policy
    assert "r" in policy._requests and policy.rate("r") != policy.rate("never-seen")
    if end == "abort":
        scheduler.finish_requests(["r"], RequestStatus.FINISHED_ABORTED)
    else:
        while not request.is_finished:
            step(scheduler, runner)
    assert "r" not in policy._requests
    assert policy.rate("r") == policy.rate("never-seen")
    assert "o" in policy._requests


def test_auto_without_a_step_time_model_drafts_and_learns():
    scheduler = make_scheduler(speculative=AUTO)
    runner = PeriodicRunner()
    request = periodic_request("r", [1, 2, 3], max_tokens=8)
    scheduler.add_request(request)
    step(scheduler, runner)
    assert request.spec_token_ids == [2, 3, 1]
    before = scheduler.drafting.policy.rate("r")
    step(scheduler, runner)
    assert scheduler.drafting.policy.rate("r") > before  # every draft held


# ----- a draft model in the worker ---------------------------------------------------------------


class DraftingRunner(FakeRunner):
    """The fake runner plus a fake draft model: after a step, each request asked for
    `num_draft_proposals` gets that many drafts (the fake model's own continuation, so they
    are accepted), after checking that the slots the draft model would write them in are in
    its block table."""

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        result = super().execute(output)
        for s in output.scheduled:
            if not s.num_draft_proposals:
                continue
            assert s.sample, "proposals asked of a step that samples nothing"
            tokens = list(self.tokens[s.request_id])
            drafts = []
            for index in range(s.num_draft_proposals):
                self.slot(s.request_id, len(tokens) - 1)  # (its row's KV: raises past the table)
                drafts.append(fake_model(tokens))
                tokens.append(drafts[-1])
            result.draft_token_ids[s.request_id] = drafts
        return result


def decode_until(scheduler, runner, request, steps):
    for _ in range(steps):
        step(scheduler, runner)
    assert request.is_decoding


def test_a_draft_model_is_asked_for_k_proposals_with_lookahead_blocks():
    scheduler = make_scheduler(speculative=DRAFT_MODEL)
    assert scheduler.drafting.ngram is None
    runner = DraftingRunner()
    request = make_request("r", 4, max_tokens=30)
    scheduler.add_request(request)
    decode_until(scheduler, runner, request, 1)
    for _ in range(4):
        drafts = list(request.spec_token_ids)
        output, new_tokens = step(scheduler, runner)
        s = by_id(output)["r"]
        assert s.draft_token_ids == drafts
        assert s.num_draft_proposals == K
        covered = s.num_computed_tokens + s.num_scheduled_tokens + K
        assert len(scheduler.kv.block_table("r")) == scheduler.kv.num_blocks_for(covered)
        assert len(new_tokens["r"]) == 1 + len(drafts)  # (the fake draft model is always right)
        assert len(request.spec_token_ids) == K
    assert runner.num_accepted > 0


def test_a_prompt_chunk_that_samples_nothing_asks_for_no_proposals():
    scheduler = make_scheduler(max_num_batched_tokens=8, speculative=DRAFT_MODEL)
    runner = DraftingRunner()
    request = make_request("r", 20, max_tokens=30)
    scheduler.add_request(request)
    while request.num_output_tokens == 0:
        output, _ = step(scheduler, runner)
        s = by_id(output)["r"]
        if not s.sample:
            assert s.num_draft_proposals == 0
            assert len(scheduler.kv.block_table("r")) == scheduler.kv.num_blocks_for(
                s.num_computed_tokens + s.num_scheduled_tokens)
    assert s.num_draft_proposals == K  # its last chunk samples: the first drafts come with it
    assert len(request.spec_token_ids) == K


def test_a_prompt_admitted_in_one_step_asks_for_proposals_with_its_first_token():
    """The admission path allocates the lookahead too: the first decode already verifies drafts."""
    scheduler = make_scheduler(speculative=DRAFT_MODEL)
    runner = DraftingRunner()
    request = make_request("r", 6, max_tokens=30)
    scheduler.add_request(request)
    output, _ = step(scheduler, runner)
    assert by_id(output)["r"].sample and by_id(output)["r"].num_draft_proposals == K
    assert len(request.spec_token_ids) == K
    assert len(scheduler.kv.block_table("r")) == scheduler.kv.num_blocks_for(6 + K)
    output, _ = step(scheduler, runner)
    assert by_id(output)["r"].draft_token_ids and by_id(output)["r"].num_draft_proposals == K


@pytest.mark.parametrize("num_blocks, proposals", [(3, K), (2, 0)])
def test_no_room_for_the_lookahead_means_no_proposals_not_a_preemption(num_blocks, proposals):
    """5 prompt tokens take 2 blocks of 4; the first decode (position 5) fits in them, its 3
    proposals (up to position 8) need a third block."""
    scheduler = make_scheduler(num_blocks=num_blocks, speculative=DRAFT_MODEL)
    runner = DraftingRunner()
    request = make_request("r", 5, max_tokens=30)
    scheduler.add_request(request)
    decode_until(scheduler, runner, request, 1)
    output, _ = step(scheduler, runner)
    assert by_id(output)["r"].num_draft_proposals == proposals
    assert not output.preempted_request_ids and scheduler.num_preemptions == 0
    assert len(scheduler.kv.block_table("r")) == 2 + (proposals > 0)


def test_a_request_without_room_for_its_lookahead_leaves_the_others_alone():
    scheduler = make_scheduler(num_blocks=5, speculative=DRAFT_MODEL)
    runner = DraftingRunner()
    a, b = make_request("a", 5, max_tokens=30), make_request("b", 5, max_tokens=30)
    for request in (a, b):
        scheduler.add_request(request)
    step(scheduler, runner)
    assert a.is_decoding and b.is_decoding and scheduler.kv.num_free_blocks == 1
    output, _ = step(scheduler, runner)
    assert [by_id(output)[r].num_draft_proposals for r in "ab"] == [K, 0]  # a took the last block for its lookahead
    assert not output.preempted_request_ids


def lookahead_pool(speculative):
    """a (5 tokens, 2 blocks) decodes within its blocks; b (4 tokens, 1 block) needs the one
    free block of 4 for its next token."""
    scheduler = make_scheduler(num_blocks=4, speculative=speculative)
    runner = DraftingRunner()
    a, b = make_request("a", 5, max_tokens=30), make_request("b", 4, max_tokens=30)
    for request in (a, b):
        scheduler.add_request(request)
    step(scheduler, runner)
    # (with a draft model, b's admission took the last block for its lookahead: a's drafts must then shrink)
    assert a.is_decoding and b.is_decoding and scheduler.kv.num_free_blocks == (1 if speculative is None else 0)
    output, _ = step(scheduler, runner)
    return output


def test_without_a_draft_model_the_lookahead_pool_preempts_nobody():
    output = lookahead_pool(None)
    assert not output.preempted_request_ids and set(by_id(output)) == {"a", "b"}


def test_a_lookahead_never_preempts_another_request():
    """a's lookahead (3 proposals: a third block) must not take the block b's own token needs."""
    output = lookahead_pool(DRAFT_MODEL)
    assert not output.preempted_request_ids
    assert set(by_id(output)) == {"a", "b"}

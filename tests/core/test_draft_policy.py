"""The draft policy: `auto` drafts only while the expected accepted tokens pay for the step
time the drafts add (by a fitted step-time model), so it turns itself off under load; how
acceptance is counted (tried positions, shadow drafts, the draft model's probes) and the
running totals /metrics shows."""

from __future__ import annotations

import random

import pytest

from chunkserve.config.speculative import SpeculativeConfig
from chunkserve.core.spec_decode.policy import PROBE_EVERY, DecodeLoad, DraftPolicy
from chunkserve.core.step_predictor import StepShape, StepTimePredictor

CONTEXT = 100
CONSTANT_S, PER_ROW_S = 0.002, 0.001  # the synthetic steps: 2 ms + 1 ms per decode row


def fitted_predictor() -> StepTimePredictor:
    """A step-time model fitted to steps of known cost: 2 ms + 1 ms per decode row, whatever
    the context lengths (so B decodes take 2 + B ms, and each draft row adds 1 ms)."""
    predictor = StepTimePredictor()
    rng = random.Random(0)
    for _ in range(64):
        rows, context = rng.randint(1, 64), rng.randint(10, 3000)
        predictor.observe(StepShape(decode_rows=rows, decode_attention=rows * context), CONSTANT_S + PER_ROW_S * rows)
    predictor.refit()
    assert predictor.predict(StepShape(decode_rows=10, decode_attention=5000)) == pytest.approx(0.012)
    return predictor


def load(num_decodes: int) -> DecodeLoad:
    """The next step's decodes: `num_decodes` of them at context CONTEXT (the request's own among them)."""
    return DecodeLoad.of([CONTEXT] * num_decodes)


def config(policy: str = "auto", method: str = "ngram", k: int = 8) -> SpeculativeConfig:
    extra = {"model": "/models/draft"} if method == "draft_model" else {}
    return SpeculativeConfig.parse({"method": method, "num_speculative_tokens": k, "policy": policy, **extra})


def teach(policy: DraftPolicy, request_id: str, drafted: int, accepted: int, times: int = 40) -> None:
    for _ in range(times):
        policy.observe(request_id, drafted, accepted)


def high_rate_policy(**kwargs) -> DraftPolicy:
    """`r` accepts 4 of every 5 tried positions (rate ~0.8). A saved step is valued at the mean
    of the step's time per token and one row's time: one decode alone gains 0.8 x (3 + 1) / 2 ms
    per draft for 1 ms of step time, but among 32 decodes 0.8 x (34/32 + 1) / 2 ms < 1 ms."""
    policy = DraftPolicy(config(**kwargs), fitted_predictor())
    teach(policy, "r", 5, 4)
    assert policy.rate("r") == pytest.approx(0.8, abs=0.01)
    return policy


def test_auto_drafts_for_a_single_stream_with_a_high_rate():
    policy = high_rate_policy()
    assert policy.num_drafts("r", 3, load(1), CONTEXT) == 3
    k = policy.num_drafts("r", 8, load(1), CONTEXT)
    assert k == 3  # (0.8^k x 2 ms < 1 ms from the fourth: the tail does not pay)


def test_auto_turns_drafting_off_under_load_and_back_on():
    policy = high_rate_policy()
    assert policy.num_drafts("r", 5, load(32), CONTEXT) == 0
    assert policy.num_drafts("r", 5, load(2), CONTEXT) > 0  # the load fell


def test_auto_values_a_saved_step_between_a_refilled_and_a_drained_slot():
    """Rate 0.75 among 4 decodes (6 ms steps, 1 ms a row): a token's share of the step, 1.5 ms,
    would pay for a 1 ms draft row (1.125 ms expected), but the mean with the row's own 1 ms
    (1.25 ms, 0.94 expected) does not; among 2 decodes (2 ms a token) it does."""
    policy = DraftPolicy(config(), fitted_predictor())
    teach(policy, "r", 4, 3)
    assert policy.rate("r") == pytest.approx(0.75, abs=0.01)
    assert policy.num_drafts("r", 1, load(4), CONTEXT) == 0
    assert policy.num_drafts("r", 1, load(2), CONTEXT) == 1


def test_auto_gives_a_low_rate_no_drafts_even_alone():
    policy = DraftPolicy(config(), fitted_predictor())
    teach(policy, "r", 4, 0)  # every first draft rejected
    assert policy.rate("r") < 0.1
    assert policy.num_drafts("r", 5, load(1), CONTEXT) == 0


def test_always_gives_every_available_draft():
    policy = DraftPolicy(config("always"), fitted_predictor())
    teach(policy, "r", 4, 0)
    assert policy.num_drafts("r", 5, load(32), CONTEXT) == 5
    assert policy.num_drafts("r", 0, load(1), CONTEXT) == 0


@pytest.mark.parametrize("predictor", [None, StepTimePredictor()], ids=["none", "unfitted"])
def test_without_a_fitted_step_time_model_auto_drafts(predictor):
    policy = DraftPolicy(config(), predictor)
    teach(policy, "r", 4, 0)  # even a hopeless rate: the first steps teach the model
    assert policy.num_drafts("r", 4, load(32), CONTEXT) == 4
    assert policy.num_drafts("r", 0, load(1), CONTEXT) == 0


def test_observe_counts_tried_positions():
    """Position i is tried only if every draft before it held: a run of 2 accepted out of 4
    tried 3 positions (the third was rejected); 4 of 4 tried 4."""
    policy = DraftPolicy(config("always"), None)  # (always: the rate is the global one)
    assert policy.rate("x") == pytest.approx(0.5)  # (0 + 1) / (0 + 2)
    policy.observe("a", 4, 2)
    assert policy.rate("x") == pytest.approx((2 + 1) / (3 + 2))
    policy.observe("a", 4, 4)
    assert policy.rate("x") == pytest.approx((6 + 1) / (7 + 2))
    policy.observe("a", 3, 0)
    assert policy.rate("x") == pytest.approx((6 + 1) / (8 + 2))
    policy.observe("a", 0, 0)  # no drafts: nothing tried
    assert policy.rate("x") == pytest.approx((6 + 1) / (8 + 2))


def test_stats_total_runs_tokens_and_accepted_by_position():
    policy = DraftPolicy(config("always", k=4), None)
    assert policy.stats().num_drafts == 0 and policy.stats().accepted_per_pos == (0, 0, 0, 0)
    for drafted, accepted in [(4, 2), (4, 4), (3, 0), (2, 1), (0, 0)]:
        policy.observe("a", drafted, accepted)
    stats = policy.stats()
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (4, 13, 7)
    assert stats.accepted_per_pos == (3, 2, 1, 1)
    assert stats.mean_acceptance_length == pytest.approx(1 + 7 / 4)


def test_a_request_rate_follows_its_own_recent_drafts():
    policy = DraftPolicy(config(), None)
    teach(policy, "good", 4, 4)
    teach(policy, "bad", 4, 0)
    assert policy.rate("good") > 0.9 > 0.3 > policy.rate("bad")
    teach(policy, "good", 4, 0, times=10)  # it stopped quoting: older counts decay
    assert policy.rate("good") < 0.5 < policy.rate("never-seen")


def test_shadow_drafts_move_the_rate():
    policy = DraftPolicy(config(), None)
    policy.set_shadow("r", 7)
    before = policy.rate("r")
    policy.observe_next_token("r", 7)  # the model produced what the proposal said
    after_hit = policy.rate("r")
    assert after_hit > before
    policy.observe_next_token("r", 9)  # no shadow pending now: nothing counted
    assert policy.rate("r") == after_hit
    policy.set_shadow("r", 7)
    policy.observe_next_token("r", 8)
    assert policy.rate("r") < after_hit
    policy.set_shadow("r", None)  # no proposal: nothing to check
    rate = policy.rate("r")
    policy.observe_next_token("r", 3)
    assert policy.rate("r") == rate
    assert policy.stats().num_drafts == 0  # shadows are not verified drafts


def test_shadows_teach_auto_to_start_drafting():
    policy = DraftPolicy(config(), fitted_predictor())
    teach(policy, "r", 4, 0)
    assert policy.num_drafts("r", 4, load(1), CONTEXT) == 0
    for _ in range(30):  # the proposals it did not get would have been right
        policy.set_shadow("r", 5)
        policy.observe_next_token("r", 5)
    assert policy.num_drafts("r", 4, load(1), CONTEXT) > 0


def test_draft_model_requests_not_drafting_are_probed():
    policy = DraftPolicy(config(method="draft_model"), fitted_predictor())
    teach(policy, "r", 4, 0)
    decisions = [policy.num_drafts("r", 3, load(1), CONTEXT) for _ in range(2 * (PROBE_EVERY + 1))]
    assert decisions == ([0] * PROBE_EVERY + [3]) * 2


def test_ngram_requests_are_never_probed():
    policy = DraftPolicy(config(), fitted_predictor())
    teach(policy, "r", 4, 0)
    assert not any(policy.num_drafts("r", 3, load(1), CONTEXT) for _ in range(3 * PROBE_EVERY))


def test_forget_drops_a_request_state():
    policy = DraftPolicy(config(), None)
    teach(policy, "gone", 4, 4)
    teach(policy, "other", 4, 0)
    prior = policy.rate("never-seen")
    assert policy.rate("gone") != prior
    policy.forget("gone")
    assert policy.rate("gone") == prior

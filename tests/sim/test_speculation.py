"""N-gram speculative decoding in the simulator: the engine's own proposer and draft policy on
synthetic text whose drafts hold at a set rate (executor/simulated.py's SyntheticText)."""

from __future__ import annotations

import json

import pytest

from chunkserve.errors import InvalidRequestError
from chunkserve.sim.profile import StepTimeProfile, fit_profile
from chunkserve.sim.simulator import simulate
from chunkserve.sim.trace import SimRequest
from tests.sim.support import PROFILE, engine_args

REQUESTS = [SimRequest(tuple(range(3000 + 500 * i, 3000 + 500 * i + 200)), 300, 0.05 * i) for i in range(8)]


def speculative(policy: str, k: int = 4) -> str:
    return json.dumps({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                       "prompt_lookup_max": 4, "policy": policy})


@pytest.mark.parametrize("rate", [0.5, 0.8])
def test_drafts_hold_at_the_rate_given_and_every_request_ends_at_its_length(rate):
    run = simulate(REQUESTS, engine_args(speculative_config=speculative("always")), PROFILE,
                   draft_acceptance_rate=rate)
    assert [r.completion_tokens for r in run.results] == [300] * len(REQUESTS) and all(r.ok for r in run.results)
    stats = run.replicas[0].core.scheduler.stats().spec_decode
    # every verified run has a first draft: the share of them that held is the rate
    assert stats.num_drafts > 250 and stats.accepted_per_pos[0] / stats.num_drafts == pytest.approx(rate, abs=0.06)
    again = simulate(REQUESTS, engine_args(speculative_config=speculative("always")), PROFILE,
                     draft_acceptance_rate=rate)
    assert again.step_records() == run.step_records()


# a step whose rows cost little beside its fixed cost (a GPU's memory-bound decode): drafts pay there
ROWS_CHEAP = StepTimeProfile({"constant": 0.02, "prefill_rows": 1e-4, "decode_rows": 1e-4})


def test_the_engines_draft_policy_speculates_where_drafts_pay_and_not_where_they_do_not():
    """`auto` (the engine's policy, weighing each draft on the simulated step times) against
    `always`, drafts holding 80% of the time: where a row costs little beside the step, it
    speculates and the requests end sooner than without; where a row costs about what a
    token saves (PROFILE, this CPU's shape), it declines and ends sooner than `always`."""
    def run(profile, policy):
        flags = {} if policy is None else {"speculative_config": speculative(policy)}
        result = simulate(REQUESTS, engine_args(**flags), profile, draft_acceptance_rate=0.8 if policy else None)
        stats = result.replicas[0].core.scheduler.stats().spec_decode
        return max(r.end_time for r in result.results), stats.num_draft_tokens if stats else 0

    plain, auto = run(ROWS_CHEAP, None), run(ROWS_CHEAP, "auto")
    assert auto[1] > 1000 and auto[0] < 0.7 * plain[0]
    plain, auto, always = run(PROFILE, None), run(PROFILE, "auto"), run(PROFILE, "always")
    assert auto[1] < 0.05 * always[1] and auto[0] < always[0] and auto[0] == pytest.approx(plain[0], rel=0.02)


def test_a_profile_measures_the_rate_and_a_simulation_without_one_is_refused():
    records = simulate(REQUESTS, engine_args(speculative_config=speculative("always")), PROFILE,
                       draft_acceptance_rate=0.5).step_records()
    fitted = fit_profile(records)
    drafted = sum(line["num_draft_tokens"] for line in records)
    assert fitted.draft_acceptance_rate == pytest.approx(sum(line["num_accepted_tokens"] for line in records) / drafted)
    with pytest.raises(InvalidRequestError, match="--draft-acceptance-rate"):
        simulate(REQUESTS, engine_args(speculative_config=speculative("auto")), PROFILE)

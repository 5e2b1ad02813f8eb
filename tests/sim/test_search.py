"""The rate search and sweeps of `chunkserve sim`."""

from __future__ import annotations

import pytest

from chunkserve.errors import InvalidRequestError
from chunkserve.sim.profile import StepTimeProfile
from chunkserve.sim.search import SLO, search_rate
from chunkserve.sim.simulator import result_json, simulate
from chunkserve.sim.trace import from_workload
from tests.sim.support import engine_args, workload

STEP_S = 0.01


def test_the_rate_search_finds_the_m_d_1_queues_capacity():
    """One request at a time (max_num_seqs 1), every step 10 ms, two tokens each: the engine is
    an M/D/1 queue with service time D = 2 steps, and a request's TTFT is its wait plus one step.
    The mean wait is rho D / (2 (1 - rho)) (Pollaczek-Khinchine), so a mean TTFT of at most 30 ms
    holds up to rho = 2/3: 33.3 requests/s. A finite run starts with an empty queue, so its mean
    wait is below the stationary one and the search lands a few percent high."""
    profile = StepTimeProfile({"constant": STEP_S})
    service = 2 * STEP_S
    wait = 0.030 - STEP_S
    expected = (2 * wait / (service + 2 * wait)) / service

    def run_at(rate: float) -> dict:
        requests = from_workload(workload(request_rate=rate, num_prompts=600, input_len=16, output_len=2, seed=4))
        run = simulate(requests, engine_args(max_num_seqs=1), profile)
        return result_json(run, profile, "q", "random", {})["summary"]

    found, probes = search_rate(run_at, [SLO.parse("ttft_mean=30")], 1.0, 100.0)
    assert found == pytest.approx(expected, rel=0.08)
    assert [p["passed"] for p in probes[:2]] == [False, True]  # the highest rate fails, the lowest passes


def test_a_search_whose_slos_hold_everywhere_or_nowhere_says_so():
    def run_at(latency_ms: float):
        return lambda rate: {"failed": 0, "ttft_ms": {"p90": latency_ms}}

    assert search_rate(run_at(10.0), [SLO.parse("ttft_p90=100")], 0.5, 8.0)[0] == 8.0
    assert search_rate(run_at(500.0), [SLO.parse("ttft_p90=100")], 0.5, 8.0)[0] is None


@pytest.mark.parametrize("text", ["ttft=100", "ttft_p95=100", "speed_p50=3", "tbt_p99=-1", "tbt_p99"])
def test_a_bad_slo_is_refused_with_the_form_it_needs(text):
    with pytest.raises(InvalidRequestError, match="METRIC_PERCENTILE=MS"):
        SLO.parse(text)

"""A simulated run: deterministic for a seed, blind to the host's clocks, the workload's
shape kept (output lengths, prefix sharing, chats), results as `bench serve` writes them."""

from __future__ import annotations

import dataclasses
import time

import pytest

from chunkserve.errors import InvalidRequestError
from chunkserve.sim.simulator import result_json, simulate
from chunkserve.sim.link import LinkModel
from chunkserve.sim.trace import SimRequest, from_workload
from tests.sim.support import PROFILE, engine_args, workload


def summary_of(run) -> dict:
    return result_json(run, PROFILE, "t", "random", {})["summary"]


def test_a_seed_gives_the_same_run_and_another_seed_another():
    requests = from_workload(workload(request_rate=8.0))
    first, again = (simulate(requests, engine_args(seed=1), PROFILE) for _ in range(2))
    assert [dataclasses.asdict(r) for r in first.results] == [dataclasses.asdict(r) for r in again.results]
    assert first.step_records() == again.step_records()
    other = simulate(requests, engine_args(seed=2), PROFILE)
    assert [r.token_times for r in other.results] != [r.token_times for r in first.results]


def test_the_host_clocks_never_reach_the_simulated_time(monkeypatch):
    """With every host clock jumping by an hour at each read, the simulated run is unchanged."""
    requests = from_workload(workload(request_rate=8.0))
    expected = simulate(requests, engine_args(), PROFILE)
    jumps = {"now": 1e9}

    def jumping() -> float:
        jumps["now"] += 3600.0
        return jumps["now"]

    for name in ("time", "perf_counter", "monotonic"):
        monkeypatch.setattr(time, name, jumping)
    jumped = simulate(requests, engine_args(), PROFILE)
    monkeypatch.undo()
    assert [dataclasses.asdict(r) for r in jumped.results] == [dataclasses.asdict(r) for r in expected.results]
    assert jumped.step_records() == expected.step_records()


def test_every_request_ends_at_its_output_length_and_the_latencies_are_where_they_belong():
    requests = from_workload(workload(workload="sharegpt-like", request_rate=4.0, num_prompts=30))
    run = simulate(requests, engine_args(), PROFILE)
    assert [r.completion_tokens for r in run.results] == [r.output_len for r in requests]
    assert all(r.ok and len(r.token_times) == r.output_len for r in run.results)
    records = run.step_records()
    first_step = records[0]["start_time"]
    # the engine idles until the first request reaches it
    assert first_step == pytest.approx(requests[0].arrival + PROFILE.request_latency_s)
    first_token = run.results[0].token_times[0]
    assert first_token == pytest.approx(first_step + records[0]["duration_s"] + PROFILE.output_latency_s)


def test_the_steps_are_the_engines_mixed_batches_within_the_budget():
    run = simulate(from_workload(workload(workload="interference")), engine_args(max_num_batched_tokens=128), PROFILE)
    records = run.step_records()
    assert max(r["num_prefill_tokens"] + r["num_decode_tokens"] for r in records) <= 128
    # the long prompts' chunks beside the streams' decodes
    assert any(r["num_prefill_tokens"] and r["num_decode_tokens"] for r in records)
    assert all(r["duration_s"] > 0 and r["shape"] for r in records)


def test_a_shared_prefix_is_read_from_the_cache_unless_caching_is_off():
    requests = from_workload(workload(workload="prefix", request_rate=2.0, num_prompts=12, input_len=32))
    cached = summary_of(simulate(requests, engine_args(), PROFILE))
    uncached = summary_of(simulate(requests, engine_args(enable_prefix_caching=False), PROFILE))
    assert cached["prefix_cache_hit_rate"] > 0.8 and uncached["prefix_cache_hit_rate"] == 0
    assert cached["ttft_ms"]["p50"] < uncached["ttft_ms"]["p50"]


def test_a_chats_next_turn_arrives_its_think_time_after_the_last_turn_ended():
    requests = from_workload(workload(workload="multi-turn", num_prompts=2, turns=3, think_time=0.5))
    run = simulate(requests, engine_args(), PROFILE)
    for index, request in enumerate(requests):
        if request.after is not None:
            assert run.results[index].send_time == pytest.approx(run.results[request.after].end_time + 0.5)


def test_the_prefix_router_keeps_each_system_prompt_on_one_replica_and_round_robin_spreads_it():
    requests = from_workload(workload(workload="prefix", num_prefixes=2, request_rate=4.0, num_prompts=16,
                                      input_len=16))
    rates = {}
    for router in ("prefix", "round-robin"):
        run = simulate(requests, engine_args(), PROFILE, replicas=4, router=router)
        rates[router] = summary_of(run)["prefix_cache_hit_rate"]
        assert {r.ok for r in run.results} == {True}
        assert {line["replica"] for line in run.step_records()} <= {0, 1, 2, 3}
    assert rates["prefix"] > rates["round-robin"]


def test_least_load_sends_a_burst_to_every_replica():
    run = simulate(from_workload(workload(num_prompts=8)), engine_args(), PROFILE, replicas=4, router="least-load")
    assert {line["replica"] for line in run.step_records()} == {0, 1, 2, 3}


@pytest.mark.parametrize("pd", [None, (1, 1)])
def test_a_request_the_server_would_refuse_fails_with_its_message_and_the_others_are_served(pd):
    """Prompt and output over max_model_len: the server answers 400 (its frontend checks), so the
    simulated client gets that error at once and the engine never sees the request."""
    fits = SimRequest(tuple(range(2000, 2100)), 8, 0.0)
    too_long = SimRequest(tuple(range(3000, 3500)), 100, 0.1)
    run = simulate([fits, too_long, fits], engine_args(max_model_len=512), PROFILE, pd=pd,
                   link=LinkModel(1e9) if pd else None)
    assert [r.ok for r in run.results] == [True, False, True]
    refused = run.results[1]
    assert refused.error.startswith("400: prompt (500 tokens) + max_tokens (100) = 600 exceeds max_model_len (512")
    assert refused.end_time == pytest.approx(too_long.arrival + PROFILE.request_latency_s) and not refused.token_times
    # the engines computed the two 100-token prompts at most, never the refused 500 tokens
    assert sum(line["num_prefill_tokens"] for line in run.step_records()) <= 200


@pytest.mark.parametrize("flags, named", [(dict(pipeline_parallel_size=2, distributed_executor_backend="mp"),
                                           "--pipeline-parallel-size"),
                                          (dict(speculative_config='{"method": "draft_model", '
                                                                   '"num_speculative_tokens": 2, "model": "draft.gguf"}'),
                                           '"draft_model"')])
def test_what_cannot_be_simulated_is_refused_by_its_flag(flags, named):
    with pytest.raises(InvalidRequestError, match=named):
        simulate(from_workload(workload(num_prompts=1)), engine_args(**flags), PROFILE)


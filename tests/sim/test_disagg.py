"""Prefill/decode fleets in the simulator (`--pd P:D`): the engine's own disaggregation
connector (scheduler sides) on every instance, the KV moving over a simulated link."""

from __future__ import annotations

import dataclasses
import math

import pytest

from chunkserve.errors import InvalidRequestError
from chunkserve.sim.disagg import HEADER_BYTES
from chunkserve.sim.link import LinkModel
from chunkserve.sim.simulator import result_json, simulate
from chunkserve.sim.trace import SimRequest, from_workload
from tests.sim.support import PROFILE, engine_args, workload

LINK = LinkModel(bytes_per_s=2e9, latency_s=50e-6)


def kv_bytes_received(run) -> int:
    return sum(r.core.scheduler.connector.get_kv_connector_stats().bytes_total for r in run.replicas)


def test_prompts_run_on_the_prefill_side_decodes_on_the_decode_side_and_every_block_comes_back():
    requests = from_workload(workload(workload="sharegpt-like", request_rate=4.0, num_prompts=30))
    run = simulate(requests, engine_args(), PROFILE, pd=(2, 2), link=LINK)
    assert [r.completion_tokens for r in run.results] == [r.output_len for r in requests]
    assert all(r.ok and len(r.token_times) == r.output_len for r in run.results)
    records = run.step_records()
    prefill_steps = [line for line in records if line["role"] == "prefill"]
    decode_steps = [line for line in records if line["role"] == "decode"]
    assert {line["replica"] for line in records} == {"prefill-0", "prefill-1", 0, 1}  # both pools took requests
    assert all(line["num_decode_tokens"] == 0 for line in prefill_steps)
    assert all(line["num_prefill_tokens"] == 0 for line in decode_steps)
    # every prompt's KV crossed once, whole (no prefix is shared here)
    block_bytes = run.link.block_bytes
    assert kv_bytes_received(run) == sum(math.ceil(len(r.prompt_token_ids) / 16) for r in requests) * block_bytes
    for engine in run.engines:  # every block free or cached, no room or request left on either side
        assert engine.core.check()["ok"], engine.core.check()
    again = simulate(requests, engine_args(), PROFILE, pd=(2, 2), link=LINK)
    assert [dataclasses.asdict(r) for r in again.results] == [dataclasses.asdict(r) for r in run.results]
    simulator = result_json(run, PROFILE, "pd", "sharegpt-like", {})["simulator"]
    assert simulator["pd"] == [2, 2] and simulator["kv_link"] == LINK.describe()


def test_the_first_token_waits_for_the_blocks_on_the_wire_and_their_copies():
    """A 1,000-token prompt in one step: the decode side's bootstrap reaches the prefill
    instance during that step, so all 63 blocks leave after it, then the final message; the
    first token comes when both have crossed: two latencies plus their bytes over the rate."""
    request = [SimRequest(tuple(range(2000, 3000)), 4, 0.0)]
    args = engine_args(max_num_batched_tokens=1024)
    fast = simulate(request, args, PROFILE, pd=(1, 1), link=LinkModel(1e15, 0.0))
    slow_link = LinkModel(1e8, 1e-3)
    slow = simulate(request, args, PROFILE, pd=(1, 1), link=slow_link)
    copying_link = dataclasses.replace(slow_link, send_s_per_block=1e-3, receive_s_per_block=2e-3)
    copying = simulate(request, args, PROFILE, pd=(1, 1), link=copying_link)
    ttft = [run.results[0].token_times[0] - run.results[0].send_time for run in (fast, slow, copying)]
    wire = 2 * slow_link.latency_s + (63 * slow.link.block_bytes + 2 * HEADER_BYTES) / slow_link.bytes_per_s
    assert ttft[1] - ttft[0] == pytest.approx(wire, abs=1e-6)
    # the engine threads' copies: out of the prefill pool before the blocks leave, into the decode
    # pool once they are in (the final message, right behind them, has arrived by then)
    final_message = slow_link.latency_s + HEADER_BYTES / slow_link.bytes_per_s
    assert ttft[2] - ttft[1] == pytest.approx(63 * (1e-3 + 2e-3) - final_message, abs=1e-6)


def test_a_decode_instance_keeps_its_streams_out_of_the_prompt_chunks():
    """The interference workload: colocated, the streams' tokens wait for each prompt chunk; with
    a prefill instance beside, the decode instance's steps are decodes alone."""
    requests = from_workload(workload(workload="interference", streams=4, long_prompts=2, long_len=2048,
                                      long_every=1.0, long_start=0.5, stream_output_len=96))
    args = engine_args(max_num_batched_tokens=512)
    colocated = result_json(simulate(requests, args, PROFILE), PROFILE, "c", "interference", {})
    split = result_json(simulate(requests, args, PROFILE, pd=(1, 1), link=LINK), PROFILE, "pd", "interference", {})
    assert colocated["interference"]["tbt_during_long_ms"]["p99"] > 200  # a 512-token chunk step
    assert split["interference"]["tbt_during_long_ms"]["p99"] < colocated["interference"]["tbt_during_long_ms"]["p99"] / 5
    assert split["summary"]["completed"] == colocated["summary"]["completed"] == len(requests)


def test_a_decode_pool_too_small_for_the_burst_makes_requests_wait_and_all_finish():
    """60 blocks a side and eight 300-token prompts at once: the decode side pre-allocates what
    fits (3 requests), the others wait to bootstrap while the prefill side holds their blocks."""
    requests = [SimRequest(tuple(range(3000 + 400 * i, 3300 + 400 * i)), 64, 0.0) for i in range(8)]

    def most_decoding(run) -> int:
        return max(line["num_decode_tokens"] for line in run.step_records() if line["role"] == "decode")

    tight = simulate(requests, engine_args(num_kv_blocks=60, max_num_batched_tokens=256), PROFILE, pd=(1, 1),
                     link=LINK)
    roomy = simulate(requests, engine_args(max_num_batched_tokens=256), PROFILE, pd=(1, 1), link=LINK)
    assert most_decoding(tight) == 3 < most_decoding(roomy)
    assert all(r.ok and r.completion_tokens == 64 for r in tight.results)
    for engine in tight.engines:
        assert engine.core.check()["ok"], engine.core.check()


@pytest.mark.parametrize("call, message", [
    (lambda r: simulate(r, engine_args(), PROFILE, replicas=2, pd=(1, 1), link=LINK), "not both"),
    (lambda r: simulate(r, engine_args(), PROFILE, pd=(1, 1)), "--kv-link-gbps"),
    (lambda r: simulate([dataclasses.replace(r[0], n=2)], engine_args(), PROFILE, pd=(1, 1), link=LINK), "n above 1"),
])
def test_what_a_prefill_decode_fleet_cannot_serve_is_refused(call, message):
    requests = from_workload(workload(num_prompts=2))
    with pytest.raises(InvalidRequestError, match=message):
        call(requests)

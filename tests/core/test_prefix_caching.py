"""Prefix caching in the scheduler, with the fake runner of test_scheduler: a request reuses
the cached blocks of a shared prefix and computes only the rest, outputs do not change, and
blocks in use are never evicted."""

from __future__ import annotations

import hashlib
import random

import pytest

from chunkserve.core.request import Request, RequestStatus
from chunkserve.core.sched.scheduler import Scheduler
from chunkserve.sampling_params import SamplingParams
from tests.core.support import (
    EOS,
    FakeRunner,
    assert_pool_free,
    assert_references_match_tables,
    make_scheduler,
    run,
)


def request(request_id: str, prompt: list[int], max_tokens: int = 4, priority: int = 0) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   eos_token_id=EOS, priority=priority)


def tokens(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 900) for _ in range(length)]


def step(scheduler: Scheduler, runner: FakeRunner) -> None:
    output = scheduler.schedule()
    scheduler.update_from_output(output, runner.execute(output))


def shared_prefix_workload(seed: int) -> list[Request]:
    """Groups of requests sharing prefixes of 0 to 40 tokens, some prompts exactly block-sized."""
    rng = random.Random(seed)
    requests = []
    for group in range(5):
        prefix = tokens(100 + group, rng.choice([4, 8, 13, 24, 40]))
        for i in range(rng.randint(2, 4)):
            suffix = tokens(1000 * group + i, rng.choice([0, 1, 5, 8, 17]) if i else rng.choice([1, 5]))
            requests.append(request(f"g{group}-{i}", prefix + suffix, max_tokens=rng.randint(1, 12)))
    rng.shuffle(requests)
    return requests


def test_second_request_computes_only_its_suffix():
    scheduler, runner = make_scheduler(), FakeRunner()
    prefix = tokens(0, 32)
    first = request("first", prefix + tokens(1, 5))
    run(scheduler, [first], runner=runner)
    assert first.num_cached_tokens == 0
    computed_before = runner.num_computed
    second = request("second", prefix + tokens(2, 7), max_tokens=4)
    run(scheduler, [second], runner=runner)
    assert second.num_cached_tokens == 32
    assert runner.num_computed - computed_before == 7 + 3  # the suffix, then 3 decodes
    assert scheduler.prefix_cache_hits == 32 and scheduler.prefix_cache_queries == 37 + 39


@pytest.mark.parametrize("prompt_len, expected_hit", [(16, 12), (17, 16), (3, 0)])
def test_a_fully_cached_prompt_still_computes_its_last_block(prompt_len, expected_hit):
    scheduler, runner = make_scheduler(), FakeRunner()
    prompt = tokens(3, prompt_len)
    run(scheduler, [request("a", prompt)], runner=runner)
    again = request("b", prompt)
    outputs = run(scheduler, [again], runner=runner)
    assert again.num_cached_tokens == expected_hit
    assert outputs["b"] == run(make_scheduler(), [request("c", prompt)])["c"]


@pytest.mark.parametrize("config", [
    dict(max_num_batched_tokens=8),
    dict(max_num_batched_tokens=13, max_num_seqs=4),
    dict(max_num_batched_tokens=32),
    dict(max_num_batched_tokens=100, enable_chunked_prefill=False),
    dict(max_num_batched_tokens=16, num_blocks=24),
    dict(max_num_batched_tokens=16, num_blocks=24, scheduling_policy="priority"),
    dict(max_num_batched_tokens=32, enable_mixed_batch=False, max_num_partial_prefills=3),
], ids=["budget8", "budget13", "budget32", "no-chunking", "tiny-pool", "tiny-pool-priority", "no-mixing"])
def test_outputs_are_the_same_with_caching_on_and_off(config):
    outputs = {}
    computed = {}
    for caching in (True, False):
        scheduler, runner = make_scheduler(**config, enable_prefix_caching=caching), FakeRunner()
        workload = shared_prefix_workload(seed=7)
        for i, r in enumerate(workload):
            r.priority = i % 3
        first_wave, second_wave = workload[: len(workload) // 2], workload[len(workload) // 2:]
        outputs[caching] = run(scheduler, first_wave, assert_references_match_tables, runner=runner)
        outputs[caching] |= run(scheduler, second_wave, assert_references_match_tables, runner=runner)
        computed[caching] = runner.num_computed
        assert_pool_free(scheduler)
    assert outputs[True] == outputs[False]
    assert computed[True] < computed[False]


def test_eviction_under_pressure_keeps_blocks_in_use():
    """A pool too small for the workload: cached blocks are evicted and requests preempted,
    but no block a running request holds is ever handed to another."""
    scheduler, runner = make_scheduler(num_blocks=14, max_num_batched_tokens=16), FakeRunner()
    for wave in range(4):
        run(scheduler, shared_prefix_workload(seed=wave), assert_references_match_tables, runner=runner)
    assert scheduler.kv.pool.num_evictions > 0 and scheduler.num_preemptions > 0
    assert_pool_free(scheduler)


def test_a_preempted_request_finds_its_own_blocks_again():
    readmitted_hits = []

    def check(scheduler, output):
        assert_references_match_tables(scheduler, output)
        for new in output.new_requests:  # first scheduling: never preempted yet
            assert new.request_id not in preempted
        for s in output.scheduled:
            if s.request_id in preempted and s.request_id not in seen_after_preemption:
                seen_after_preemption.add(s.request_id)
                readmitted_hits.append(s.num_computed_tokens)
        for request_id in output.preempted_request_ids:
            preempted.add(request_id)
            seen_after_preemption.discard(request_id)

    preempted, seen_after_preemption = set(), set()
    random.seed(2)
    requests = [request(f"r{i}", tokens(i, random.randint(8, 30)), max_tokens=random.randint(10, 30))
                for i in range(12)]
    run(make_scheduler(num_blocks=30, max_num_batched_tokens=16), requests, check)
    assert readmitted_hits and max(readmitted_hits) > 0, "no preempted request reused its blocks"


def test_a_chunked_prompt_caches_its_chunks_as_they_complete():
    scheduler, runner = make_scheduler(max_num_batched_tokens=8), FakeRunner()
    prompt = tokens(5, 40)
    scheduler.add_request(request("long", prompt))
    for done_steps in range(1, 4):
        step(scheduler, runner)
        probe = request(f"probe{done_steps}", prompt[:36] + [1, 2, 3])
        blocks, num_cached = scheduler.kv.get_computed_blocks(probe)
        assert num_cached == 8 * done_steps and blocks == scheduler.kv.block_table("long")[: 2 * done_steps]


def test_an_aborted_prompt_leaves_its_computed_blocks_cached():
    scheduler, runner = make_scheduler(max_num_batched_tokens=8), FakeRunner()
    prompt = tokens(6, 40)
    scheduler.add_request(request("aborted", prompt))
    for _ in range(2):
        step(scheduler, runner)
    scheduler.finish_requests(["aborted"], RequestStatus.FINISHED_ABORTED)
    assert_pool_free(scheduler)
    again = request("again", prompt)
    run(scheduler, [again], runner=runner)
    assert again.num_cached_tokens == 16


def test_caching_off_computes_every_prompt_whole():
    scheduler, runner = make_scheduler(enable_prefix_caching=False), FakeRunner()
    prompt = tokens(8, 20)
    run(scheduler, [request("a", prompt, max_tokens=1)], runner=runner)
    second = request("b", prompt, max_tokens=1)
    run(scheduler, [second], runner=runner)
    assert second.num_cached_tokens == 0 and runner.num_computed == 40
    assert scheduler.kv.pool.num_cached_blocks == 0


def test_reset_prefix_cache_is_refused_while_requests_are_unfinished():
    scheduler, runner = make_scheduler(), FakeRunner()
    prompt = tokens(9, 20)
    run(scheduler, [request("a", prompt)], runner=runner)
    scheduler.add_request(request("b", tokens(10, 9)))
    assert not scheduler.reset_prefix_cache()
    run(scheduler, [], runner=runner)
    assert scheduler.reset_prefix_cache()
    assert scheduler.kv.pool.num_cached_blocks == 0
    again = request("c", prompt)
    run(scheduler, [again], runner=runner)
    assert again.num_cached_tokens == 0


def test_block_hashes_are_a_sha256_chain():
    from chunkserve.core.kv.kv_cache_manager import ROOT_HASH, hash_block

    block = [5, 6, 7, 8]
    first = hash_block(ROOT_HASH, block)
    assert first == hashlib.sha256(ROOT_HASH + b"".join(t.to_bytes(8, "little") for t in block)).digest()
    assert hash_block(first, block) != first, "a block's hash must depend on its whole prefix"
    assert hash_block(ROOT_HASH, [5, 6, 7, 9]) != first
    scheduler = make_scheduler()
    probe = request("probe", block + block + [1])
    scheduler.kv.get_computed_blocks(probe)
    assert scheduler.kv.block_hashes("probe") == [first, hash_block(first, block)]


def test_a_prompt_whose_next_block_another_request_is_computing_waits_and_reads_it():
    """n samples of one prompt, or the same system prompt twice at once: admitted together,
    each would compute the shared blocks; the second waits until the first has, then reads them."""
    scheduler, runner = make_scheduler(max_num_batched_tokens=16), FakeRunner()
    shared = tokens(7, 30)  # 7 full blocks and 2 tokens
    first, second = request("first", shared), request("second", shared)
    third = request("other", tokens(8, 10))  # behind them, unrelated: it is not held up
    scheduled: list[list[str]] = []
    outputs = run(scheduler, [first, second, third], runner=runner,
                  check=lambda s, output: scheduled.append([r.request_id for r in output.scheduled]))
    first_step = {rid: next(i for i, step in enumerate(scheduled) if rid in step) for rid in ("second", "other")}
    assert first_step["other"] <= first_step["second"] and first_step["second"] >= 2  # "other" was not held up
    assert second.num_cached_tokens == 28  # every full block, computed once
    assert runner.num_computed == 30 + 3 + (30 - 28) + 3 + 10 + 3
    assert outputs["first"] == outputs["second"]


def test_no_waiting_without_prefix_caching():
    scheduler = make_scheduler(enable_prefix_caching=False, max_num_batched_tokens=64)
    first, second = request("first", tokens(7, 30)), request("second", tokens(7, 30))
    for r in (first, second):
        scheduler.add_request(r)
    assert [s.request_id for s in scheduler.schedule().scheduled] == ["first", "second"]

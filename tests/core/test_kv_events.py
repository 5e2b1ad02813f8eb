"""KV events from the scheduler's caches: a router that applies them in order holds exactly the
blocks the prefix cache holds, after every step of a workload with shared prefixes, salts,
duplicates computed at once, evictions, preemptions and a reset; each announcement names its
blocks as the engine hashes them (the low 64 bits of the chain hash), with their parent, token
ids and the salt as vLLM's events carry them."""

from __future__ import annotations

import random

from chunkserve.core.kv.events import (
    MEDIUM_POOL,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventLog,
    external_block_hash,
)
from chunkserve.core.kv.kv_cache_manager import hash_block, root_hash
from chunkserve.core.request import Request
from chunkserve.sampling_params import SamplingParams
from tests.core.support import BLOCK, EOS, FakeRunner, make_scheduler


def apply(index: set[int], events: list) -> None:
    for event in events:
        if isinstance(event, AllBlocksCleared):
            index.clear()
        elif isinstance(event, BlockStored):
            assert event.medium == MEDIUM_POOL and event.block_size == BLOCK
            assert len(event.token_ids) == BLOCK * len(event.block_hashes)
            assert event.parent_block_hash is None or event.parent_block_hash in index, "a parent never announced"
            assert not index & set(event.block_hashes), "a block announced twice"
            index.update(event.block_hashes)
        else:
            assert isinstance(event, BlockRemoved) and set(event.block_hashes) <= index, "an unknown block removed"
            index.difference_update(event.block_hashes)


def cached(scheduler) -> set[int]:
    return {external_block_hash(h) for h, _ in scheduler.kv.pool.cached_blocks()}


def workload(rng: random.Random, n: int) -> list[Request]:
    prefixes = [[rng.randint(1, 900) for _ in range(rng.choice([8, 13, 20]))] for _ in range(3)]
    requests = []
    for i in range(n):
        prompt = rng.choice(prefixes) + [rng.randint(1, 900) for _ in range(rng.randint(1, 12))]
        salt = rng.choice([None, None, "alice", "bob"])
        requests.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 9), ignore_eos=True),
                                eos_token_id=EOS, cache_salt=salt))
    return requests


def test_applied_events_equal_the_prefix_cache_after_every_step():
    for seed in range(6):
        rng = random.Random(seed)
        scheduler = make_scheduler(num_blocks=24, max_num_batched_tokens=16, enable_kv_cache_events=True)
        runner, index = FakeRunner(BLOCK), set()
        pending = workload(rng, 40)
        while pending or scheduler.has_unfinished_requests():
            for _ in range(rng.randint(0, 3)):
                if pending:
                    scheduler.add_request(pending.pop(0))
            output = scheduler.schedule()
            scheduler.update_from_output(output, runner.execute(output))
            apply(index, scheduler.kv.events.take())
            assert index == cached(scheduler), f"seed {seed}: the events disagree with the cache"
        assert scheduler.kv.pool.num_evictions > 0  # (evictions were exercised)
        assert scheduler.reset_prefix_cache()
        events = scheduler.kv.events.take()
        assert isinstance(events[-1], AllBlocksCleared)
        apply(index, events)
        assert index == set() == cached(scheduler)


def test_an_announcement_names_blocks_as_the_engine_hashes_them():
    scheduler = make_scheduler(enable_kv_cache_events=True)
    runner = FakeRunner(BLOCK)
    prompt = list(range(1, 11))  # two full blocks, then two tokens
    scheduler.add_request(Request("a", prompt, SamplingParams(max_tokens=1), eos_token_id=EOS, cache_salt="s"))
    output = scheduler.schedule()
    scheduler.update_from_output(output, runner.execute(output))
    [stored] = scheduler.kv.events.take()
    first = hash_block(root_hash("s"), prompt[:4])
    second = hash_block(first, prompt[4:8])
    assert stored.block_hashes == [external_block_hash(first), external_block_hash(second)]
    assert stored.parent_block_hash is None and stored.token_ids == prompt[:8]
    assert stored.extra_keys == [("s",), None]  # the salt on the sequence's first block, as vLLM
    assert external_block_hash(second) == int.from_bytes(second[-8:], "big")


def test_removals_in_a_row_are_one_event():
    log = KVEventLog(BLOCK)
    for i in range(3):
        log.removed(bytes([i]) * 32)
    log.cleared()
    log.removed(b"\x09" * 32)
    removed, cleared, last = log.take()
    assert len(removed.block_hashes) == 3 and isinstance(cleared, AllBlocksCleared) and len(last.block_hashes) == 1
    assert log.take() == []


def test_no_events_without_the_flag():
    scheduler = make_scheduler()
    assert scheduler.kv.events is None and scheduler.kv.pool.events is None

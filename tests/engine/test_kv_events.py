"""KV events on the wire from a real engine (--kv-events-config): a ZMQ subscriber decoding
vLLM 0.32's message layout (tests/kv_events_wire.py) holds exactly the blocks the engine reports
cached (`cached_blocks`, the admin endpoint's answer) at every quiet point: shared prefixes,
evictions from a small pool, a prefix-cache reset, the disk tier's files under their own medium,
announced again by a restarted engine. Messages are numbered from 0 without gaps, and the replay
socket gives back what a late subscriber missed."""

from __future__ import annotations

import pytest

from chunkserve.config import EngineArgs
from chunkserve.engine.llm_engine import LLMEngine
from chunkserve.sampling_params import SamplingParams
from tests.kv_events_wire import (
    AllBlocksCleared,
    BlockStored,
    Subscriber,
    index_of,
    replay,
)

BLOCK = 16
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
SYSTEM = [1000 + (i * 37) % 5000 for i in range(40)]
pytestmark = pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)


def events_config(folder) -> dict:
    return {"enable_kv_cache_events": True, "endpoint": f"ipc://{folder}/events",
            "replay_endpoint": f"ipc://{folder}/replay", "topic": "kv@test"}


def make_engine(model_dir: str, folder, **overrides) -> LLMEngine:
    """Twelve blocks: a few prompts fit, more evict the oldest."""
    args = dict(model=model_dir, num_kv_blocks=12, block_size=BLOCK, max_num_batched_tokens=64,
                kv_events_config=events_config(folder))
    args.update(overrides)
    return LLMEngine(EngineArgs(dtype="float32", **args))


def run(engine: LLMEngine, prompts: list[list[int]]) -> None:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"q{len(engine.engine_core.step_records)}-{i}", prompt, PARAMS)
    while engine.has_unfinished_requests():
        engine.step()


def connected(engine: LLMEngine, subscriber: Subscriber, prompt: list[int]) -> None:
    """Run requests until the subscriber has received a message (ZMQ's subscription takes a
    moment to reach the publisher; what it missed comes from the replay socket). Each attempt's
    prompt starts with a token of its own: a prompt the cache holds already stores no block, and
    so publishes nothing."""
    attempt = 0
    while not subscriber.messages:
        run(engine, [[4000 + attempt] + prompt])
        subscriber.drain(settle_s=0.2)
        attempt += 1


def router_view(engine: LLMEngine, subscriber: Subscriber, folder) -> dict[str, set[int]]:
    """What a router holds: the replayed messages it missed, then every live one, numbered without gaps."""
    subscriber.drain()
    first_live = subscriber.messages[0][0]
    missed = replay(f"ipc://{folder}/replay", 0)
    assert [seq for seq, _ in missed][:first_live] == list(range(first_live))
    messages = missed[:first_live] + subscriber.messages
    assert [seq for seq, _ in messages] == list(range(len(messages))), "a message was lost"
    return index_of(messages)


def engine_view(engine: LLMEngine) -> dict[str, set[int]]:
    return {medium: set(hashes) for medium, hashes in engine.engine_core.cached_blocks()["blocks"].items() if hashes}


def test_a_subscriber_holds_what_the_engine_caches(tiny_model_dir, tmp_path):
    engine = make_engine(tiny_model_dir, tmp_path)
    subscriber = Subscriber(f"ipc://{tmp_path}/events", b"kv@test")
    try:
        connected(engine, subscriber, SYSTEM + [5, 6, 7])
        run(engine, [SYSTEM + [8] * 20, SYSTEM + [9] * 30])  # a shared prefix
        assert router_view(engine, subscriber, tmp_path) == engine_view(engine)
        run(engine, [[2000 + i] * 60 for i in range(3)])  # more than the pool: the oldest blocks go
        assert engine.engine_core.scheduler.kv.pool.num_evictions > 0
        assert router_view(engine, subscriber, tmp_path) == engine_view(engine)
        stored = [e for _, batch in subscriber.messages for e in batch.events if isinstance(e, BlockStored)]
        assert all(e.medium == "GPU" and e.block_size == BLOCK and len(e.token_ids) == BLOCK * len(e.block_hashes)
                   for e in stored)
        assert all(batch.data_parallel_rank == 0 for _, batch in subscriber.messages)
        assert engine.reset_prefix_cache()
        subscriber.drain()
        assert isinstance(subscriber.messages[-1][1].events[-1], AllBlocksCleared)
        assert router_view(engine, subscriber, tmp_path) == {} == engine_view(engine)
    finally:
        subscriber.close()
        engine.shutdown()


def test_the_disk_tier_is_announced_as_storage_and_again_after_a_restart(tiny_model_dir, tmp_path):
    tier = dict(enable_hierarchical_cache=True, hicache_storage_dir=str(tmp_path / "tier"))
    engine = make_engine(tiny_model_dir, tmp_path, **tier)
    subscriber = Subscriber(f"ipc://{tmp_path}/events")
    try:
        connected(engine, subscriber, SYSTEM + [5, 6, 7])
        run(engine, [SYSTEM + [8] * 20])
        view = router_view(engine, subscriber, tmp_path)
        assert view == engine_view(engine) and view["STORAGE"]
    finally:
        subscriber.close()
        engine.shutdown()
    files = engine_view(engine)["STORAGE"]
    restarted = make_engine(tiny_model_dir, tmp_path, **tier)
    try:  # what a restarted engine announces first is the files it found
        [(seq, batch)] = replay(f"ipc://{tmp_path}/replay", 0)
        assert seq == 0 and {h for e in batch.events for h in e.block_hashes} == files
        assert all(e.medium == "STORAGE" and e.token_ids == [] for e in batch.events)
    finally:
        restarted.shutdown()

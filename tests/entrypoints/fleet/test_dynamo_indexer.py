"""Dynamo's standalone KV indexer (`python -m dynamo.indexer`, the `fleet` extra) following two
chunkserve replicas' KV events, as a Dynamo or custom router would: at every quiet point its block
set per replica is the replica's own cached set, its overlap answer for a prompt is the number of
blocks the replica then reads from its cache, and after the indexer is killed and restarted the
replicas' replay sockets make its index whole again. Prompts are never a whole number of blocks
long: an engine recomputes a fully cached prompt's last token, so there the two would differ by
design."""

from __future__ import annotations

import random

import pytest

from chunkserve.bench.kv_indexer import KVIndexer
from tests.entrypoints.fleet.event_replicas import (
    BLOCK_SIZE,
    EventReplica,
    start_event_replicas,
    stop_event_replicas,
)

pytestmark = pytest.mark.slow

NUM_KV_BLOCKS = 40  # 640 tokens a replica: the load below evicts
VOCAB = (100, 40000)


class Fleet:
    """Two replicas, the indexer following both, and the tally of its overlap answers."""

    def __init__(self, replicas: list[EventReplica], log_folder) -> None:
        self.replicas = replicas
        self.log_folder = log_folder
        self.indexer: KVIndexer | None = None
        self.answers = self.exact = 0
        self.evicted: set[int] = set()
        self.seen: set[int] = set()

    def start_indexer(self) -> None:
        self.indexer = KVIndexer(str(self.log_folder / "indexer.log"), BLOCK_SIZE)
        for instance, replica in enumerate(self.replicas):
            self.indexer.register(instance, replica.events, replica.replay)

    def send(self, instance: int, prompt: list[int]) -> None:
        """`prompt` to one replica, after asking the indexer what that replica will find cached."""
        assert len(prompt) % BLOCK_SIZE
        predicted = self.indexer.overlap_blocks(prompt).get(instance, 0)
        cached_tokens = self.replicas[instance].complete(prompt)
        self.answers += 1
        self.exact += predicted == cached_tokens // BLOCK_SIZE
        self.assert_in_step()

    def assert_in_step(self) -> None:
        """Wait until the indexer holds each replica's cached blocks exactly (events arrive
        asynchronously), and remember the blocks that left a pool."""
        engine = {instance: replica.cached_blocks() for instance, replica in enumerate(self.replicas)}
        self.indexer.wait_until(lambda held: all(held.get(i, set()) == blocks for i, blocks in engine.items()))
        now = set().union(*engine.values())
        self.evicted |= self.seen - now
        self.seen |= now


def random_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(count)]


def odd_length(prompt: list[int], rng: random.Random) -> list[int]:
    return prompt + random_tokens(rng, 1) if len(prompt) % BLOCK_SIZE == 0 else prompt


def prefix_heavy_load(fleet: Fleet, rng: random.Random, requests: int) -> None:
    """Requests sharing one of two system prompts, spread over the replicas."""
    systems = [random_tokens(rng, 40), random_tokens(rng, 70)]
    for i in range(requests):
        prompt = systems[i % 2] + random_tokens(rng, rng.randrange(5, 60))
        fleet.send(rng.randrange(2), odd_length(prompt, rng))


def multi_turn_load(fleet: Fleet, rng: random.Random, chats: int, turns: int) -> None:
    """Chats resending their history each turn, mostly to the replica of their first turn."""
    histories = [random_tokens(rng, 30 + 7 * chat) for chat in range(chats)]
    for turn in range(turns):
        for chat in range(chats):
            histories[chat] = odd_length(histories[chat] + random_tokens(rng, 20), rng)
            instance = (chat + (turn == turns - 1)) % 2
            fleet.send(instance, histories[chat])


def test_the_indexer_holds_each_replicas_cached_blocks_and_recovers_by_replay(tmp_path_factory, tiny_gguf):
    replicas = start_event_replicas(tmp_path_factory, tiny_gguf, 2, "--num-kv-blocks", str(NUM_KV_BLOCKS))
    fleet = Fleet(replicas, tmp_path_factory.mktemp("indexer"))
    rng = random.Random(0)
    try:
        fleet.start_indexer()
        prefix_heavy_load(fleet, rng, 12)
        multi_turn_load(fleet, rng, chats=4, turns=3)
        assert fleet.evicted, "the load was meant to evict blocks"

        replicas[0].reset_prefix_cache()
        fleet.assert_in_step()
        assert fleet.indexer.device_blocks().get(0, set()) == set() != fleet.indexer.device_blocks()[1]

        fleet.indexer.stop()
        for instance, replica in enumerate(replicas):  # events the indexer never receives
            replica.complete(odd_length(random_tokens(rng, 50 + instance), rng))
        fleet.start_indexer()
        for replica in replicas:  # a new listener replays what it missed once the replica's next message shows the gap
            replica.complete(odd_length(random_tokens(rng, 30), rng))
        fleet.assert_in_step()
        prefix_heavy_load(fleet, rng, 4)
        multi_turn_load(fleet, rng, chats=2, turns=2)

        assert fleet.exact >= 0.99 * fleet.answers, f"{fleet.exact} of {fleet.answers} overlap answers exact"
    finally:
        if fleet.indexer is not None:
            fleet.indexer.stop()
        stop_event_replicas(replicas)

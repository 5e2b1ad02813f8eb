"""A KV-event subscriber as routers build one: vLLM 0.32's documented message layout as msgspec
structs (`vllm/distributed/kv_events.py`: `EventBatch` array-like, events maps tagged by
`type`, unknown fields rejected so a misspelt field fails), a SUB socket, a replay client, and
the index a router keeps (block hashes per medium). The `vllm` package is not a dependency;
benchmarks/peers/kv_events_conformance.py decodes with vLLM's own structs."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq

END_OF_REPLAY = -1


class BlockStored(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(KVEventBatch)


class Subscriber:
    """A SUB socket on one engine's events; `messages` holds (seq, batch) in arrival order."""

    def __init__(self, endpoint: str, topic: bytes = b"") -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic)
        self.socket.connect(endpoint)
        self.messages: list[tuple[int, KVEventBatch]] = []

    def drain(self, settle_s: float = 0.3) -> None:
        """Receive until nothing arrives for `settle_s` (the engine is idle, so nothing more is coming)."""
        while self.socket.poll(int(settle_s * 1000)):
            _, seq, payload = self.socket.recv_multipart()
            self.messages.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


def replay(endpoint: str, first_seq: int, timeout_s: float = 10.0) -> list[tuple[int, KVEventBatch]]:
    """Ask the engine's replay socket for every buffered message from `first_seq` on."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.connect(endpoint)
    try:
        socket.send_multipart((b"", first_seq.to_bytes(8, "big")))
        messages, deadline = [], time.monotonic() + timeout_s
        while True:
            assert socket.poll(int(max(deadline - time.monotonic(), 0) * 1000)), "the replay did not end"
            _, _, seq, payload = socket.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == END_OF_REPLAY:
                return messages
            messages.append((seq, DECODER.decode(payload)))
    finally:
        socket.close(linger=0)
        context.term()


def index_of(messages: list[tuple[int, KVEventBatch]]) -> dict[str, set[int]]:
    """The block hashes a router would hold per medium after applying `messages` in order."""
    index: dict[str, set[int]] = {}
    for _, batch in messages:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                index.clear()
            elif isinstance(event, BlockStored):
                index.setdefault(event.medium, set()).update(event.block_hashes)
            else:
                index.setdefault(event.medium, set()).difference_update(event.block_hashes)
    return {medium: hashes for medium, hashes in index.items() if hashes}

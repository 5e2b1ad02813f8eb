"""Publishing KV cache events (core/kv/events.py) on vLLM's wire, so the routers that read
vLLM's events (Dynamo's KV router and indexer, llm-d, Ray's KV-aware router) read ours.

The wire (vLLM 0.32's `ZmqEventPublisher`, `vllm/distributed/kv_events.py`):
- a PUB socket sends one message per engine step that changed the cache: frames
  `[topic, sequence number (8 bytes, big-endian, from 0), payload]`, the payload msgpack
  `[timestamp, [event, ...], data_parallel_rank]`, each event a map tagged by its `type`
  (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`) with vLLM's field names;
- a ROUTER socket (`replay_endpoint`) answers a subscriber that missed messages: it sends the
  first sequence number it lacks (8 bytes, big-endian) and gets every buffered message from
  there as `[topic, sequence, payload]`, then `[b"", -1, b""]`.

The engine thread sends between steps and never waits: the send is NOBLOCK (libzmq's I/O
thread does the rest; past `hwm` queued messages for a slow subscriber, PUB drops, as it does
for vLLM). Replays are served by a thread of their own that sleeps in zmq's poll (no GIL)
and wakes only for a replay request, rare (a subscriber restarted or saw a gap).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import msgspec
import zmq

from chunkserve.config.kv_events import KVEventsConfig
from chunkserve.core.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
REPLAY_POLL_MS = 200  # how soon the replay thread sees `close`


def wire_form(event: KVCacheEvent) -> dict:
    """An event as vLLM's msgspec struct encodes it (tag `type`, defaults left out)."""
    if isinstance(event, BlockStored):
        fields = {"type": "BlockStored", "block_hashes": event.block_hashes,
                  "parent_block_hash": event.parent_block_hash, "token_ids": event.token_ids,
                  "block_size": event.block_size, "lora_id": None, "medium": event.medium, "lora_name": None}
        if event.extra_keys is not None:
            fields["extra_keys"] = event.extra_keys
        fields["group_idx"] = 0
        fields["kv_cache_spec_kind"] = "full_attention"  # (every layer's KV is full attention here)
        return fields
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium, "group_idx": 0}
    assert isinstance(event, AllBlocksCleared)
    return {"type": "AllBlocksCleared"}


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard, IPv6 any, ipc:// or inproc:// endpoint is bound, any other
    connected to (a collector that binds, such as llm-d's, takes engines' connections)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._topic = config.topic.encode()
        self._encoder = msgspec.msgpack.Encoder()
        self._next_seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._buffer_lock = threading.Lock()
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.num_dropped = 0
        self._closed = threading.Event()
        self._replay_thread: threading.Thread | None = None
        try:
            (self._pub.bind if binds(config.endpoint) else self._pub.connect)(config.endpoint)
            if config.replay_endpoint is not None:
                replay = self._context.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.bind(config.replay_endpoint)
                self._replay_thread = threading.Thread(target=self._serve_replays, args=(replay,),
                                                       name="kv-events-replay", daemon=True)
                self._replay_thread.start()
        except zmq.ZMQError as error:
            self.close()
            raise OSError(f"kv_events_config: cannot open {config.endpoint!r} / {config.replay_endpoint!r}: "
                          f"{error}") from None
        logger.info("publishing KV events on %s%s", config.endpoint,
                    f", replay on {config.replay_endpoint}" if config.replay_endpoint else "")

    def publish(self, events: list[KVCacheEvent]) -> None:
        """One message with `events` (none: nothing is sent). Never blocks."""
        if not events:
            return
        payload = self._encoder.encode([time.time(), [wire_form(e) for e in events], self.data_parallel_rank])
        seq = self._next_seq
        self._next_seq += 1
        with self._buffer_lock:
            self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # (a connected endpoint not up yet, or hwm reached): replay recovers it
            self.num_dropped += 1

    def close(self) -> None:
        self._closed.set()
        if self._replay_thread is not None:
            self._replay_thread.join()
        self._pub.close()
        self._context.term()

    def _serve_replays(self, socket: zmq.Socket) -> None:
        try:
            while not self._closed.is_set():
                if socket.poll(REPLAY_POLL_MS):
                    self._replay(socket, socket.recv_multipart())
        finally:
            socket.close()

    def _replay(self, socket: zmq.Socket, frames: list[bytes]) -> None:
        """Frames: [client identity, b"", first sequence number wanted] (a REQ or DEALER client)."""
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events replay: ignoring a malformed request of %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        with self._buffer_lock:
            wanted = [(seq, payload) for seq, payload in self._buffer if seq >= first]
        for seq, payload in wanted:
            socket.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        socket.send_multipart((client, b"", b"", END_OF_REPLAY, b""))

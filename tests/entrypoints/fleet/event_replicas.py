"""Tiny-model chunkserve replicas publishing KV events (--kv-events-config) on loopback ports of
their own, for the tests that hold a KV-event router's view against what each engine caches."""

from __future__ import annotations

import json
from dataclasses import dataclass

from tests.server_process import (
    Server,
    free_port,
    start_server,
    stop_server,
    wait_until_up,
)
from tests.tiny_model import TINY_SERVER_ENV, tiny_server_flags

BLOCK_SIZE = 16


@dataclass
class EventReplica:
    server: Server
    events: str  # where a subscriber connects
    replay: str

    def cached_blocks(self) -> set[int]:
        """The hashes of the blocks in the engine's KV pool now (GET /debug/kv_cache_blocks)."""
        with self.server.admin_client() as http:
            return set(http.get("/debug/kv_cache_blocks").json()["blocks"].get("GPU", []))

    def complete(self, prompt: list[int], max_tokens: int = 4) -> int:
        """Send `prompt` (token ids), greedy; the prompt tokens the replica says it read from its cache."""
        with self.server.client() as http:
            response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                          "temperature": 0, "ignore_eos": True})
        response.raise_for_status()
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def reset_prefix_cache(self) -> None:
        with self.server.admin_client() as http:
            http.post("/reset_prefix_cache").raise_for_status()


def start_event_replicas(tmp_path_factory, gguf: str, count: int, *flags: str) -> list[EventReplica]:
    """`count` replicas on the tiny model, started side by side, each binding its event and
    replay sockets on free ports."""
    pending = []
    for index in range(count):
        events, replay = free_port(), free_port()
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events}",
                  "replay_endpoint": f"tcp://*:{replay}", "topic": ""}
        server = start_server(tmp_path_factory, *tiny_server_flags(gguf, max_model_len=512),
                              "--block-size", str(BLOCK_SIZE), "--kv-events-config", json.dumps(config), *flags,
                              name=f"replica{index}", env=TINY_SERVER_ENV, wait=False)
        pending.append(EventReplica(server, f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}"))
    try:
        for replica in pending:
            wait_until_up(replica.server)
    except Exception:
        stop_event_replicas(pending)
        raise
    return pending


def stop_event_replicas(replicas: list[EventReplica]) -> None:
    for replica in replicas:
        stop_server(replica.server)

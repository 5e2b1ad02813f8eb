"""NVIDIA Dynamo's standalone KV indexer (`python -m dynamo.indexer`, from the `ai-dynamo-runtime`
wheel) as a process: started by the server harness, told which replicas to follow, asked what it
holds. The fleet benchmark routes on its answers and the tests certify chunkserve's KV events
against it, so both drive it through this one client.

What the indexer does (ai-dynamo-runtime 1.6.1, standalone mode: no etcd, NATS or Dynamo runtime):
- `POST /register {instance_id, endpoint, replay_endpoint, model_name, block_size}` opens a ZMQ
  SUB to the replica's event endpoint (vLLM's wire) and a DEALER to its replay endpoint. Its
  subscriber does not retry a connection refused at registration: register a replica once it
  is up. A listener expects sequence 0 first; on a gap (a fresh listener that sees sequence N,
  or a dropped message) it asks the replay socket for what it missed, so after a restart the
  index is whole again once the replica publishes its next message.
- `GET /dump` answers, per `model:routing_group`, the stored-block events that rebuild its radix
  tree now (removed blocks are gone from it), each with the `worker_id` and `storage_tier`
  ("device" for vLLM's medium "GPU").
- `POST /query {token_ids, model_name}` hashes the tokens block by block as the engine does and
  answers `scores[instance_id][dp_rank]`: the tokens of the longest cached prefix (whole blocks).
"""

from __future__ import annotations

import importlib.util
import sys
import time

import httpx

from chunkserve.bench.service import Service

MODEL_NAME = "chunkserve"  # the indexer's tree name: every replica serves the same model
DEVICE_TIER = "device"
INSTALL_HINT = "pip install 'chunkserve[fleet]'"
REQUEST_TIMEOUT_S = 30


def indexer_command(threads: int = 1) -> list[str]:
    """`python -m dynamo.indexer` with this interpreter (the harness adds --port); one thread
    indexes a few replicas' events with room to spare."""
    if importlib.util.find_spec("dynamo") is None or importlib.util.find_spec("dynamo.indexer") is None:
        raise RuntimeError(f"Dynamo's KV indexer is not installed: {INSTALL_HINT} (ai-dynamo-runtime)")
    return [sys.executable, "-m", "dynamo.indexer", "--threads", str(threads)]


class IndexerClient:
    """Talks to a running indexer at `url`: registers replicas, reads its index, asks overlaps."""

    def __init__(self, url: str, block_size: int) -> None:
        self.http = httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S)
        self.block_size = block_size

    def register(self, instance_id: int, endpoint: str, replay_endpoint: str | None) -> None:
        """Follow a replica's events (`endpoint`, connectable: tcp://127.0.0.1:PORT) and recover
        gaps from its `replay_endpoint`. The replica must already be publishing (bound)."""
        body = {"instance_id": instance_id, "endpoint": endpoint, "model_name": MODEL_NAME,
                "block_size": self.block_size}
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        self._post("/register", body)

    def device_blocks(self) -> dict[int, set[int]]:
        """Instance id -> the hashes of the blocks the indexer believes are in its KV pool."""
        tree = self._get("/dump").get(f"{MODEL_NAME}:default", {"events": []})
        blocks: dict[int, set[int]] = {}
        for event in tree["events"]:
            stored = event["event"]["data"].get("stored")
            if stored is not None and event["storage_tier"] == DEVICE_TIER:
                blocks.setdefault(event["worker_id"], set()).update(b["block_hash"] for b in stored["blocks"])
        return blocks

    def overlap_blocks(self, token_ids: list[int]) -> dict[int, int]:
        """Instance id -> how many leading whole blocks of `token_ids` it holds (absent: none)."""
        answer = self._post("/query", {"token_ids": token_ids, "model_name": MODEL_NAME})
        return {int(instance): max(ranks.values()) // self.block_size for instance, ranks in answer["scores"].items()}

    def wait_until(self, condition, timeout_s: float = 30.0, poll_s: float = 0.05) -> dict[int, set[int]]:
        """`device_blocks()` once `condition` holds for it; AssertionError with the last answer
        after `timeout_s` (events reach the indexer asynchronously)."""
        deadline = time.monotonic() + timeout_s
        while True:
            blocks = self.device_blocks()
            if condition(blocks):
                return blocks
            if time.monotonic() > deadline:
                raise AssertionError(f"the indexer never met the condition; it holds {summary(blocks)}")
            time.sleep(poll_s)

    def close(self) -> None:
        self.http.close()

    def _get(self, path: str) -> dict:
        response = self.http.get(path)
        response.raise_for_status()
        return response.json()

    def _post(self, path: str, body: dict) -> dict:
        response = self.http.post(path, json=body)
        if response.status_code >= 400:
            raise RuntimeError(f"dynamo.indexer {path} answered HTTP {response.status_code}: {response.text[:500]}")
        return response.json()


class KVIndexer(IndexerClient):
    """An indexer process of our own (`cpus`: pinned there), and its client."""

    def __init__(self, log_path: str, block_size: int, cpus: str | None = None) -> None:
        self.service = Service(indexer_command(), log_path, cpus=cpus, label="dynamo.indexer")
        try:
            self.service.wait_healthy(show_log=True)
        except RuntimeError:
            self.service.stop(grace_s=0)
            raise
        super().__init__(self.service.url, block_size)

    def stop(self) -> None:
        """At once (SIGKILL): the index lives in memory only, as after a crash."""
        self.close()
        self.service.stop(grace_s=0)


def summary(blocks: dict[int, set[int]]) -> str:
    """Blocks per instance, for a failure message."""
    return ", ".join(f"instance {instance}: {len(hashes)} blocks" for instance, hashes in sorted(blocks.items())) or "nothing"

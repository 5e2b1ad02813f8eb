"""The KV-connector seam: where KV moves in and out of the pool (another instance's prefill,
a disk tier, a snapshot), with vLLM V1's verbs on both sides of the executor.

Scheduler side (in the engine core, no tensors):
  - `get_num_new_matched_tokens(request, num_computed_tokens)`: how many tokens past the local
    prefix-cache hit the connector can supply, and whether they arrive asynchronously (the
    request then waits as WAITING_FOR_REMOTE_KVS, holding its blocks, until the worker reports
    it in `finished_recving`);
  - `update_state_after_alloc(request, block_ids, num_external_tokens)`: the blocks the
    connector's tokens will land in;
  - `build_connector_meta(scheduler_output)`: what the workers must load or save this step,
    carried to them in `SchedulerOutput.kv_connector_metadata`;
  - `request_finished(request, block_ids) -> (delay_free, params)`: a finished request's
    blocks stay allocated while `delay_free` (its KV is still being sent), until the worker
    reports it in `finished_sending`. It is called for a request aborted while its KV was
    loading too: a connector with a load still in flight into those blocks must delay their
    free the same way.

Worker side (around the forward pass, with the KV tensors):
  - `bind_connector_metadata(metadata)`, `start_load_kv()` before the forward,
    `wait_for_layer_load(layer)` before a layer's attention reads the cache,
    `save_kv_layer(layer, k_cache, v_cache, attn_metadata)` after a layer wrote its KV,
    `wait_for_save()` after the forward, and `get_finished(finished_request_ids)` ->
    (finished sending, finished receiving), reported back in the runner's output.

`NoOpConnector` is both sides of a connector that moves nothing: the engine's behaviour
without KV transfer.
"""

from __future__ import annotations

from typing import Any

from chunkserve.core.request import Request


class KVConnectorScheduler:
    """The scheduler's side of a connector; every verb defaults to moving nothing."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        return None

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        return False, None


class KVConnectorWorker:
    """The worker's side of a connector; every verb defaults to moving nothing."""

    def bind_connector_metadata(self, metadata: Any) -> None:
        return None

    def start_load_kv(self) -> None:
        return None

    def wait_for_layer_load(self, layer: int) -> None:
        return None

    def save_kv_layer(self, layer: int, k_cache: Any, v_cache: Any, attn_metadata: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_request_ids: set[str]) -> tuple[set[str], set[str]]:
        return set(), set()


class NoOpConnector(KVConnectorScheduler, KVConnectorWorker):
    """No KV transfer: the local prefix cache is all there is."""

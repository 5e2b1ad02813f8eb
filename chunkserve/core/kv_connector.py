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
    free the same way (or cancel the load so that the worker never writes them again);
  - `bind_kv_cache(kv)`: the scheduler's KVCacheManager (its pool and hash chains), once;
  - `update_connector_output(output)`: what the worker side reported in
    `ModelRunnerOutput.kv_connector_output` (its own type), every step;
  - `has_pending_work()`: the connector still has work the engine must step for though no
    request is unfinished (saves not yet made); `begin_shutdown()`: queue what must be
    persisted before the engine stops (the engine then steps until no work is pending);
  - `reset_cache()`: forget what the connector caches (with the pool's prefix cache);
  - `get_kv_connector_stats()`: its counters for SchedulerStats (None: none);
  - `step_failed(metadata)`: the step built with `metadata` was void (its forward raised): what
    it asked the worker to send was not sent;
  - `take_failed_requests()`: requests whose transfer failed (id -> why), which the scheduler
    then finishes as aborted with that error (a disaggregated instance: never a hang);
  - `take_first_token(request_id)`: for a request whose load finished, the token another
    instance sampled after its prompt (disaggregated decode), which it continues from;
  - `registry_sizes()`: the entries of each of its per-request tables (name -> count), for the
    engine's self-check: each must be empty once no request is unfinished and no work pending.

Worker side (around the forward pass, with the KV tensors):
  - `bind_connector_metadata(metadata)`, `start_load_kv()` before the forward,
    `wait_for_layer_load(layer)` before a layer's attention reads the cache,
    `save_kv_layer(layer, k_cache, v_cache, attn_metadata)` after a layer wrote its KV,
    `wait_for_save()` after the forward, `on_step_output(output, generator_state)` after the
    sampling (every step, empty ones too: what was sampled, and each request's generator state
    on demand), and `get_finished(finished_request_ids)` ->
    (finished sending, finished receiving), reported back in the runner's output;
  - `register_kv_caches(kv_pool)`: the pool tensor, once it is allocated;
  - `get_block_ids_with_load_errors()`: blocks whose load failed (ModelRunnerOutput's
    `invalid_block_ids`; their requests recompute from the first), and
    `take_connector_output()`: what goes back to the scheduler's side, after a successful step;
  - `shutdown()`: stop its threads (after the engine settled the scheduler's side).

`NoOpConnector` is both sides of a connector that moves nothing: the engine's behaviour
without KV transfer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from chunkserve.core.messages import TokenLogprobs
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

    def bind_kv_cache(self, kv: Any) -> None:
        return None

    def update_connector_output(self, output: Any) -> None:
        return None

    def has_pending_work(self) -> bool:
        return False

    def begin_shutdown(self) -> None:
        return None

    def reset_cache(self) -> None:
        return None

    def get_kv_connector_stats(self) -> Any:
        return None

    def step_failed(self, metadata: Any) -> None:
        return None

    def take_failed_requests(self) -> dict[str, str]:
        return {}

    def take_first_token(self, request_id: str) -> Any:
        return None

    def registry_sizes(self) -> dict[str, int]:
        return {}

    def stored_block_hashes(self) -> dict[str, list[bytes]]:
        """The blocks this connector holds outside the pool, by KV-event medium (core/kv/events.py):
        what its KV events have announced and not removed."""
        return {}


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

    def on_step_output(self, sampled_token_ids: dict[str, list[int]], logprobs: dict[str, list[TokenLogprobs]],
                       generator_state: Callable[[str], bytes | None]) -> None:
        return None

    def get_finished(self, finished_request_ids: set[str]) -> tuple[set[str], set[str]]:
        return set(), set()

    def register_kv_caches(self, kv_pool: Any) -> None:
        return None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()

    def take_connector_output(self) -> Any:
        return None

    def shutdown(self) -> None:
        return None


class NoOpConnector(KVConnectorScheduler, KVConnectorWorker):
    """No KV transfer: the local prefix cache is all there is."""

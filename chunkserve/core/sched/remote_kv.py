"""The scheduler's state about KV that moves through the KV connector (kv_connector.py).

Two kinds of request outlive the scheduler's queues' view of them: one whose KV the
connector loads asynchronously (it waits as WAITING_FOR_REMOTE_KVS, holding its blocks and a
sequence slot, and runs from the tokens the load brings once the worker reports it), and a
finished one whose KV the connector still sends (its blocks stay held, apart from its id,
which a new request may reuse at once, until the worker reports them sent).

The scheduler's loop decides when a load starts and what a finished load means for the
request; this holder keeps the state in between, so that finishing a request is one call
here, and answers the self-check and the stats for it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from chunkserve.core.kv.kv_cache_manager import KVCacheManager
from chunkserve.core.kv_connector import KVConnectorScheduler
from chunkserve.core.request import Request, RequestStatus
from chunkserve.core.stats import KVTransferStats


class RemoteKV:
    """Loads in progress and finished requests' blocks held while the connector sends them."""

    def __init__(self, connector: KVConnectorScheduler, kv: KVCacheManager) -> None:
        self.connector = connector
        self.kv = kv
        self._remote_kv_tokens: dict[str, int] = {}  # computed tokens once the connector's load lands
        # finished requests' blocks, held until the connector has sent them (oldest first per id)
        self._sending: dict[str, deque[list[int]]] = {}

    @property
    def num_loading(self) -> int:
        """Requests waiting for their KV to load (each holds a sequence slot already)."""
        return len(self._remote_kv_tokens)

    @property
    def is_sending(self) -> bool:
        return bool(self._sending)

    def start_load(self, request: Request, cached_blocks: list[int], num_tokens: int) -> bool:
        """The connector loads the request's KV asynchronously: hold its blocks while it
        waits, out of the step; it runs, with `num_tokens` computed, once the worker reports
        the load finished. False (nothing taken) when the pool has no room."""
        if self.kv.allocate_slots(request.request_id, num_tokens, cached_blocks) is None:
            return False
        self.connector.update_state_after_alloc(
            request, self.kv.block_table(request.request_id), num_tokens - len(cached_blocks) * self.kv.block_size)
        request.num_computed_tokens = len(cached_blocks) * self.kv.block_size
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self._remote_kv_tokens[request.request_id] = num_tokens
        return True

    def finished_loads(self, request_ids: Iterable[str], invalid_block_ids: set[int]) -> list[tuple[str, int]]:
        """The loads the worker reports landed, as (request id, tokens computed), for the requests
        that were loading: one whose blocks failed to load (`invalid_block_ids`) computes from
        its first such block."""
        landed = []
        for request_id in request_ids:
            num_tokens = self._remote_kv_tokens.pop(request_id, None)
            if num_tokens is None:
                continue
            table = self.kv.block_table(request_id) if invalid_block_ids else []
            first_bad = next((i for i, block_id in enumerate(table) if block_id in invalid_block_ids), None)
            if first_bad is not None:
                num_tokens = min(num_tokens, first_bad * self.kv.block_size)
            landed.append((request_id, num_tokens))
        return landed

    def release_sent(self, request_ids: Iterable[str]) -> None:
        """The connector sent these finished requests' KV: their held blocks are freed (the
        oldest held per id first)."""
        for request_id in request_ids:
            held = self._sending.get(request_id)
            if held:
                self.kv.free_blocks(held.popleft())
                if not held:
                    del self._sending[request_id]

    def held_tables(self) -> list[list[int]]:
        """The block tables held for sending (live blocks, for the pool's consistency check)."""
        return [table for tables in self._sending.values() for table in tables]

    def forget(self, request: Request) -> None:
        """The request finished: the connector learns it, and its blocks are freed, or held
        while the connector still sends them."""
        request_id = request.request_id
        delay_free, _ = self.connector.request_finished(request, self.kv.block_table(request_id))
        if delay_free:  # held apart from the id, which a new request may reuse at once
            self._sending.setdefault(request_id, deque()).append(self.kv.detach(request_id))
        else:
            self.kv.remove_request(request_id)
        self._remote_kv_tokens.pop(request_id, None)

    def stats(self) -> dict:
        """The connector's counters, as SchedulerStats' field for their kind."""
        stats = self.connector.get_kv_connector_stats()
        if isinstance(stats, KVTransferStats):
            return {"kv_transfer": stats}
        return {"kv_tier": stats}

    def registry_sizes(self) -> dict[str, int]:
        """Entries per registry, with the connector's own (`connector.` names)."""
        sizes = {"remote_kv_tokens": len(self._remote_kv_tokens), "sending": len(self._sending)}
        sizes.update({f"connector.{name}": size for name, size in self.connector.registry_sizes().items()})
        return sizes


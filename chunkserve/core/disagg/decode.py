"""The decode instance's connector, scheduler side: a request paired with a prefill instance
computes nothing of its prompt here; its KV arrives from there.

A request's life here (SGLang's states):
  - *bootstrapping*: waiting for admission; once its blocks fit, the scheduler pre-allocates
    them all (the prompt's, past what this pool's prefix cache already holds) and the request
    waits as WAITING_FOR_REMOTE_KVS: the worker asks the prefill instance for the missing blocks
    only (`first_block`: the delta travels), granting it a window of blocks in flight;
  - *pre-allocated*, then *transferring* once bytes arrive: the worker copies arrived blocks
    into the pool between steps, on the engine thread (so an abort frees the blocks at once:
    late blocks for an ended room are dropped, never written);
  - the final message carries the first token (sampled there), its logprobs, the seeded
    generator's state and the prefill side's prefix-cache hit, and a digest of every block: the
    request then continues as a decode here (`take_first_token`).
Every state has a deadline: `waiting_timeout` from the first admission attempt to the last
byte aborts the request and frees its blocks; a failure the worker sees (a bad digest, a
refused bootstrap, the prefill instance gone) aborts it at once.
"""

from __future__ import annotations

import logging
from collections import deque
import time
from collections.abc import Callable
from dataclasses import dataclass

from chunkserve.config.kv_connector import KVConnectorConfig
from chunkserve.core.disagg.protocol import (
    DecodeMetadata,
    DecodeOutput,
    FirstToken,
    Receive,
    TransferParams,
    prompt_digest,
)
from chunkserve.core.kv.layout import ModelFingerprint
from chunkserve.core.kv_connector import KVConnectorScheduler
from chunkserve.core.request import Request
from chunkserve.core.messages import SchedulerOutput
from chunkserve.core.stats import RECENT_LATENCIES, KVTransferStats

logger = logging.getLogger(__name__)

BOOTSTRAPPING, PREALLOCATED, TRANSFERRING = "bootstrapping", "preallocated", "transferring"


@dataclass
class _Room:
    request_id: str
    room: int
    deadline: float
    state: str = BOOTSTRAPPING
    started: float = 0.0  # when the blocks were pre-allocated and the prefill side asked


class DecodeConnectorScheduler(KVConnectorScheduler):
    def __init__(self, block_size: int, waiting_timeout: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.block_size = block_size
        self.waiting_timeout = waiting_timeout
        self._clock = clock
        self._rooms: dict[int, _Room] = {}
        self._by_request: dict[str, int] = {}
        self._receives: list[Receive] = []
        self._cancelled: dict[int, TransferParams] = {}
        self._failed: dict[str, str] = {}
        self._first: dict[str, FirstToken] = {}
        self._bytes = self._transfers = self._failures = self._late_messages = 0
        self._latencies: deque[float] = deque(maxlen=RECENT_LATENCIES)

    @classmethod
    def from_config(cls, config: KVConnectorConfig,
                    fingerprint: Callable[[], ModelFingerprint]) -> DecodeConnectorScheduler:
        """(The fingerprint is the worker side's business: the bootstrap checks it.)"""
        return cls(config.block_size, config.disaggregation.disaggregation_waiting_timeout)

    # ----- the scheduler's verbs --------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Every prompt token past this pool's cached blocks comes from the prefill instance."""
        params = request.kv_transfer_params
        if params is None or request.num_output_tokens:  # preempted after its KV came: it recomputes here
            return 0, False
        if request.request_id not in self._by_request:
            self._by_request[request.request_id] = params.room
            self._rooms[params.room] = _Room(request.request_id, params.room, self._clock() + self.waiting_timeout)
        return request.num_prompt_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        room = self._rooms[request.kv_transfer_params.room]
        first_block = (request.num_prompt_tokens - num_external_tokens) // self.block_size
        room.state, room.started = PREALLOCATED, self._clock()
        self._receives.append(Receive(request.request_id, request.kv_transfer_params, first_block,
                                      list(block_ids[first_block:]), prompt_digest(request.prompt_token_ids),
                                      request.num_prompt_tokens))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> DecodeMetadata:
        now = self._clock()
        for room in list(self._rooms.values()):
            if now > room.deadline:
                self._fail(room.request_id, f"its KV did not arrive within {self.waiting_timeout:g} s "
                                            f"(--disaggregation-waiting-timeout; it was {room.state})")
        meta = DecodeMetadata(self._receives, self._cancelled, scheduler_output.is_empty)
        self._receives, self._cancelled = [], {}
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """Blocks go back at once: only the engine thread writes them, and it drops the room first.
        The prefill side is told even if it was never asked (it may hold its half's blocks for us)."""
        room_id = self._by_request.pop(request.request_id, None)
        if room_id is not None:
            self._rooms.pop(room_id, None)
            self._cancelled[room_id] = request.kv_transfer_params
            self._receives = [r for r in self._receives if r.request_id != request.request_id]
        self._first.pop(request.request_id, None)
        return False, None

    def update_connector_output(self, output: DecodeOutput | None) -> None:
        if not output:
            return
        self._bytes += output.bytes_applied
        self._late_messages += output.late_messages
        now = self._clock()
        for request_id in output.progress:
            room = self._rooms.get(self._by_request.get(request_id, -1))
            if room is not None:
                room.state = TRANSFERRING
        for request_id, first, _, _ in output.received:
            room_id = self._by_request.pop(request_id, None)
            if room_id is None:
                continue
            room = self._rooms.pop(room_id)
            self._first[request_id] = first
            self._transfers += 1
            self._latencies.append(now - room.started)
        for request_id, reason in output.failed:
            self._fail(request_id, reason)

    def take_failed_requests(self) -> dict[str, str]:
        failed, self._failed = self._failed, {}
        return failed

    def take_first_token(self, request_id: str) -> FirstToken | None:
        return self._first.pop(request_id, None)

    def registry_sizes(self) -> dict[str, int]:
        return {"rooms": len(self._rooms), "by_request": len(self._by_request), "first_tokens": len(self._first)}

    def get_kv_connector_stats(self) -> KVTransferStats:
        states = [room.state for room in self._rooms.values()]
        return KVTransferStats(
            role="decode", num_bootstrapping=states.count(BOOTSTRAPPING), num_preallocated=states.count(PREALLOCATED),
            num_transferring=states.count(TRANSFERRING), bytes_total=self._bytes, transfers_total=self._transfers,
            failed_total=self._failures, late_messages_total=self._late_messages,
            recent_latencies=tuple(self._latencies))

    def _fail(self, request_id: str, reason: str) -> None:
        if request_id in self._failed or request_id not in self._by_request:
            return
        logger.warning("request %s: KV transfer failed: %s", request_id, reason)
        self._failures += 1
        self._failed[request_id] = f"KV transfer failed: {reason}"

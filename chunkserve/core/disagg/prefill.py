"""The prefill instance's connector, scheduler side: push each request's KV to the decode
instance that bootstraps its room, chunk by chunk, as the prompt is computed.

A request's life here (SGLang's states):
  - *bootstrapping*: admitted and computing, no decode instance has asked for its room yet
    (its bootstrap may also arrive before the request: it waits, `bootstrap_timeout` at most);
  - *transferring*: a decode instance asked (telling how many leading blocks it caches and how
    many blocks it lets be in flight): every step lists the blocks that step completes, past
    the decode side's cached ones and within its credits, for the worker to push after the
    forward; the step that completes the prompt samples the first token and lists the rest,
    the partial last block included, with the final metadata message;
  - the request finishes (one token): blocks still unsent stay held (`request_finished` delays
    their free) until they are out or the transfer fails.
Every wait has a deadline that frees blocks: no decode bootstrap within `bootstrap_timeout`
fails the request; a decode side that stops renewing its lease for `lease_timeout` does too;
a decode side that gives up (its abort) ends the room. Ended rooms are remembered for a while,
so a late bootstrap is told why instead of waiting out its own timeout.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from chunkserve.config.kv_connector import KVConnectorConfig
from chunkserve.core.disagg.protocol import (
    Bootstrap,
    BlockSend,
    PrefillMetadata,
    PrefillOutput,
    prompt_digest,
)
from chunkserve.core.kv.layout import ModelFingerprint
from chunkserve.core.kv_connector import KVConnectorScheduler
from chunkserve.core.request import Request, RequestStatus
from chunkserve.core.messages import SchedulerOutput
from chunkserve.core.stats import RECENT_LATENCIES, KVTransferStats

logger = logging.getLogger(__name__)

MAX_ENDED_ROOMS = 100_000


@dataclass
class _Room:
    request: Request
    room: int
    bootstrap_deadline: float
    peer: bytes | None = None
    first_block: int = 0
    credits: int = 0
    next_block: int = 0  # the next block index to list
    lease_deadline: float = 0.0
    held_blocks: list[int] | None = None  # the finished request's blocks, held until sent
    final_listed: bool = False


@dataclass
class _Early:
    bootstrap: Bootstrap
    expires: float


class PrefillConnectorScheduler(KVConnectorScheduler):
    def __init__(self, block_size: int, bootstrap_timeout: float, lease_timeout: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.block_size = block_size
        self.bootstrap_timeout = bootstrap_timeout
        self.lease_timeout = lease_timeout
        self._clock = clock
        self._kv = None
        self._rooms: dict[int, _Room] = {}
        self._by_request: dict[str, int] = {}
        self._early: dict[int, _Early] = {}
        self._ended: OrderedDict[int, str] = OrderedDict()  # room -> why it ended
        self._failed: dict[str, str] = {}
        self._fails: list[tuple[bytes, int, str]] = []
        self._released: set[str] = set()
        self._unconfirmed: set[str] = set()  # final messages listed, not yet reported handed to the socket
        self._bytes = self._transfers = self._failures = 0
        self._latencies: deque[float] = deque(maxlen=RECENT_LATENCIES)

    @classmethod
    def from_config(cls, config: KVConnectorConfig,
                    fingerprint: Callable[[], ModelFingerprint]) -> PrefillConnectorScheduler:
        """(The fingerprint is the worker side's business: the bootstrap checks it.)"""
        disaggregation = config.disaggregation
        return cls(config.block_size, disaggregation.disaggregation_bootstrap_timeout,
                   disaggregation.disaggregation_kv_lease_timeout)

    # ----- the scheduler's verbs --------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Nothing is loaded here; the first sight of a request opens its room."""
        params = request.kv_transfer_params
        if params is not None and request.request_id not in self._by_request and params.room not in self._ended:
            now = self._clock()
            room = _Room(request, params.room, now + self.bootstrap_timeout)
            self._rooms[params.room] = room
            self._by_request[request.request_id] = params.room
            early = self._early.pop(params.room, None)
            if early is not None:
                self._accept(room, early.bootstrap, now)
        return 0, False

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PrefillMetadata:
        now = self._clock()
        self._expire(now)
        meta = PrefillMetadata(idle=scheduler_output.is_empty)
        computed_after: dict[str, int] = {}
        for scheduled in scheduler_output.scheduled:
            room_id = self._by_request.get(scheduled.request_id)
            if room_id is None:
                continue
            computed_after[scheduled.request_id] = scheduled.num_computed_tokens + scheduled.num_scheduled_tokens
            if scheduled.sample:
                meta.sampling[scheduled.request_id] = room_id
        for room in list(self._rooms.values()):
            if room.peer is None or room.final_listed:
                continue
            send = self._next_send(room, computed_after)
            if send is None:
                continue
            meta.sends.append(send)
            if send.final:  # (a finished request's room is forgotten once the worker confirms the final message)
                self._unconfirmed.add(send.request_id)
        meta.fails, self._fails = self._fails, []
        meta.released, self._released = self._released, set()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        room_id = self._by_request.get(request.request_id)
        if room_id is None:
            return False, None
        room = self._rooms[room_id]
        if request.status == RequestStatus.FINISHED_ABORTED:
            self._end(room, "the prefill instance aborted the request")
            return False, None
        if room.final_listed:  # everything is out (the worker copies blocks within the step that lists them)
            self._forget(room, "the request's KV was sent")
            return False, None
        room.held_blocks = list(block_ids)
        return True, None

    def update_connector_output(self, output: PrefillOutput | None) -> None:
        if not output:
            return
        now = self._clock()
        self._bytes += output.bytes_sent
        for bootstrap in output.bootstraps:
            room = self._rooms.get(bootstrap.room)
            if room is not None:
                self._accept(room, bootstrap, now)
            elif bootstrap.room in self._ended:
                reason = f"room {bootstrap.room} ended on the prefill instance: {self._ended[bootstrap.room]}"
                self._fails.append((bootstrap.peer, bootstrap.room, reason))
            else:  # its request has not reached this instance yet
                self._early[bootstrap.room] = _Early(bootstrap, now + self.bootstrap_timeout)
        for room_id, credits in output.credits:
            room = self._rooms.get(room_id)
            if room is not None:
                room.credits += credits
                room.lease_deadline = now + self.lease_timeout
        for room_id in output.leases:
            room = self._rooms.get(room_id)
            if room is not None:
                room.lease_deadline = now + self.lease_timeout
        for room_id, reason in output.aborted:
            self._early.pop(room_id, None)
            room = self._rooms.get(room_id)
            if room is not None:
                room.peer = None  # it is gone: nothing more is sent to it
                self._fail(room, f"the decode instance gave the request up: {reason}")
            else:  # its request may still come: it then runs without a room (nobody takes its KV)
                self._remember_ended(room_id, reason)
        for request_id, _, seconds in output.sent:
            self._unconfirmed.discard(request_id)
            room = self._rooms.get(self._by_request.get(request_id, -1))
            if room is not None and room.final_listed:
                self._forget(room, "the request's KV was sent")
            self._transfers += 1
            self._latencies.append(seconds)

    def has_pending_work(self) -> bool:
        """Fails to tell, held blocks to let go, final messages not yet handed to the socket: the
        engine steps (empty steps) until they are done, even with no request left."""
        return bool(self._fails or self._released or self._unconfirmed)

    def step_failed(self, metadata: PrefillMetadata | None) -> None:
        """The step was void (its forward raised): the blocks it listed were never sent; they go
        again (the rooms' positions and credits rewind)."""
        for send in metadata.sends if metadata is not None else ():
            room = self._rooms.get(send.room)
            if room is None or room.peer != send.peer:
                continue
            room.next_block -= len(send.blocks)
            room.credits += len(send.blocks)
            room.final_listed = False
            self._unconfirmed.discard(send.request_id)

    def take_failed_requests(self) -> dict[str, str]:
        failed, self._failed = self._failed, {}
        return failed

    def get_kv_connector_stats(self) -> KVTransferStats:
        waiting = sum(room.peer is None for room in self._rooms.values())
        return KVTransferStats(
            role="prefill", num_bootstrapping=waiting + len(self._early),
            num_transferring=len(self._rooms) - waiting, bytes_total=self._bytes, transfers_total=self._transfers,
            failed_total=self._failures, recent_latencies=tuple(self._latencies))

    # ----- rooms ------------------------------------------------------------------------------------

    def _accept(self, room: _Room, bootstrap: Bootstrap, now: float) -> None:
        request = room.request
        total = -(-request.num_prompt_tokens // self.block_size)
        problem = None
        if room.peer is not None:
            problem = f"room {room.room} was bootstrapped twice"
        elif bootstrap.prompt_digest != prompt_digest(request.prompt_token_ids):
            problem = ("the prefill and decode instances tokenized the prompt differently (a different tokenizer "
                       "or chat template?)")
        elif bootstrap.num_blocks != total or not 0 <= bootstrap.first_block < total:
            problem = f"the decode instance expects {bootstrap.num_blocks} blocks from block {bootstrap.first_block}"
        if problem is not None:
            self._fails.append((bootstrap.peer, room.room, problem))
            if room.peer is None:
                self._fail(room, problem)
            return
        room.peer = bootstrap.peer
        room.first_block = room.next_block = bootstrap.first_block
        room.credits = bootstrap.credits
        room.lease_deadline = now + self.lease_timeout

    def _next_send(self, room: _Room, computed_after: dict[str, int]) -> BlockSend | None:
        """The blocks of `room` that are computed by the end of this step and not yet listed,
        within its credits."""
        request = room.request
        total = -(-request.num_prompt_tokens // self.block_size)
        request_id = request.request_id
        if room.held_blocks is not None:
            ready, table = total, room.held_blocks
        else:
            if request_id in computed_after:
                computed = computed_after[request_id]
            elif request.status == RequestStatus.RUNNING:
                computed = request.num_computed_tokens
            else:
                return None
            computed = min(computed, request.num_prompt_tokens)
            ready = total if computed == request.num_prompt_tokens else computed // self.block_size
            table = None
        count = min(ready - room.next_block, room.credits)
        if count <= 0:
            return None
        if table is None:
            table = self._kv.block_table(request_id)
        first = room.next_block
        room.next_block += count
        room.credits -= count
        room.final_listed = room.next_block == total
        return BlockSend(request_id, room.room, room.peer, [(i, table[i]) for i in range(first, first + count)],
                         final=room.final_listed, prompt_len=request.num_prompt_tokens,
                         num_cached_tokens=request.num_cached_tokens or 0)

    def bind_kv_cache(self, kv) -> None:
        self._kv = kv

    def _expire(self, now: float) -> None:
        for room in list(self._rooms.values()):
            if room.final_listed:  # all of it is on its way
                continue
            if room.peer is None and now > room.bootstrap_deadline:
                self._fail(room, f"no decode instance bootstrapped room {room.room} within "
                                 f"{self.bootstrap_timeout:g} s")
            elif room.peer is not None and now > room.lease_deadline:
                self._fail(room, f"the decode instance stopped renewing its lease on room {room.room} for "
                                 f"{self.lease_timeout:g} s")
        for room_id, early in list(self._early.items()):
            if now > early.expires:
                del self._early[room_id]
                self._fails.append((early.bootstrap.peer, room_id, f"no request with room {room_id} reached the "
                                    f"prefill instance within {self.bootstrap_timeout:g} s"))

    def _fail(self, room: _Room, reason: str) -> None:
        """The transfer failed: tell the decode side, and fail the request here (or free its held blocks)."""
        logger.warning("KV transfer of room %d failed: %s", room.room, reason)
        self._failures += 1
        self._end(room, reason)
        if room.held_blocks is not None:
            self._released.add(room.request.request_id)
        elif not room.request.is_finished:
            self._failed[room.request.request_id] = f"KV transfer failed: {reason}"

    def _end(self, room: _Room, reason: str) -> None:
        told = any(room_id == room.room for _, room_id, _ in self._fails)
        if not room.final_listed and not told:  # the worker forgets the room; a decode side that asked is told
            self._fails.append((room.peer, room.room, reason))
        self._forget(room, reason)

    def _forget(self, room: _Room, reason: str) -> None:
        self._rooms.pop(room.room, None)
        self._by_request.pop(room.request.request_id, None)
        self._remember_ended(room.room, reason)

    def _remember_ended(self, room_id: int, reason: str) -> None:
        self._ended[room_id] = reason
        while len(self._ended) > MAX_ENDED_ROOMS:
            self._ended.popitem(last=False)

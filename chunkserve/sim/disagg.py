"""Prefill/decode pairs in the simulator (`chunkserve sim --pd P:D`).

Each instance is a replica whose engine core runs the real disaggregation connector's
scheduler side (core/disagg/prefill.py or decode.py) on the replica's virtual clock: rooms,
bootstraps, pre-allocation, credits, held blocks and their deadlines are the engine's own.
What this module replaces is the connector's worker side, the sockets: messages go over a
`KVLink` that delivers each at the simulated time it would arrive (sim/link.py's model), and
the worker sides here speak the transport's protocol (worker/disagg/transport.py: bootstrap,
credit, abort one way; kv, done, fail the other) without bytes; their copies of blocks out of
and into the pools take the link model's seconds per block on the engine thread.

The decode side bootstraps a room when its scheduler pre-allocates the blocks, granting
`disaggregation_transfer_window` blocks of credit and returning credit as blocks land; the
prefill side sends the blocks each step completes, within the credit, and the final message
(the first token) once the prompt is done; the decode side reports the room received when the
final message and every block are in. Heartbeats and leases are not simulated (no instance
dies here).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Any

from chunkserve.core.disagg.protocol import (
    Bootstrap,
    DecodeMetadata,
    DecodeOutput,
    FirstToken,
    PrefillMetadata,
    PrefillOutput,
    TransferParams,
)
from chunkserve.sim.link import LinkModel

HEADER_BYTES = 200  # a message's JSON header, about: what a bootstrap or credit puts on the wire


@dataclass(order=True)
class _Delivery:
    at: float
    order: int
    message: dict[str, Any] = field(compare=False)


class KVLink:
    """The wire between every prefill instance and every decode instance: messages in flight,
    each delivered to its destination at the simulated time it arrives (in order per pair)."""

    def __init__(self, model: LinkModel, block_bytes: int) -> None:
        self.model = model
        self.block_bytes = block_bytes
        self._inboxes: dict[str, list[_Delivery]] = {}
        self._free_at: dict[tuple[str, str], float] = {}  # (source, destination) -> its last arrival
        self._order = itertools.count()
        self.bytes_sent = 0

    def send(self, source: str, destination: str, now: float, message: dict[str, Any], num_blocks: int = 0) -> float:
        """Put a message on the wire at `now`; when it arrives."""
        size = HEADER_BYTES + num_blocks * self.block_bytes
        pair = (source, destination)
        arrives = max(now, self._free_at.get(pair, now)) + self.model.latency_s + size / self.model.bytes_per_s
        self._free_at[pair] = arrives
        self.bytes_sent += size
        heapq.heappush(self._inboxes.setdefault(destination, []), _Delivery(arrives, next(self._order), message))
        return arrives

    def take(self, destination: str, now: float) -> list[dict[str, Any]]:
        """The messages for `destination` that have arrived by `now`, in arrival order."""
        inbox = self._inboxes.get(destination, [])
        arrived = []
        while inbox and inbox[0].at <= now:
            arrived.append(heapq.heappop(inbox).message)
        return arrived

    def next_arrival(self, destination: str) -> float | None:
        inbox = self._inboxes.get(destination)
        return inbox[0].at if inbox else None


def instance_params(room: int, prefill_index: int) -> TransferParams:
    """A request's pairing, as the router gives it: the room and the prefill instance (by index)."""
    return TransferParams(room, "sim", prefill_index)


def prefill_name(index: int) -> str:
    return f"prefill-{index}"


class SimPrefillConnector:
    """The prefill instance's worker side of the connector, over the simulated link."""

    def __init__(self, link: KVLink, name: str) -> None:
        self.link = link
        self.name = name
        self._meta = PrefillMetadata()
        self._first: dict[int, int] = {}  # room -> the first token sampled
        self._started: dict[int, float] = {}  # room -> when its first blocks went
        self._output = PrefillOutput()
        self._finished_sending: set[str] = set()

    def before_step(self, metadata: PrefillMetadata | None, now: float) -> float:
        """What the step's metadata says to do first (tell the failed rooms' decode sides, let
        held blocks go), then what decode instances sent that has arrived (no copy: 0 s)."""
        self._meta = metadata or PrefillMetadata()
        for peer, room, reason in self._meta.fails:
            self._forget(room)
            if peer is not None:
                self.link.send(self.name, peer.decode(), now, {"t": "fail", "room": room, "reason": reason})
        self._finished_sending |= self._meta.released
        for message in self.link.take(self.name, now):
            kind, room = message["t"], message["room"]
            if kind == "bootstrap":
                self._output.bootstraps.append(message["bootstrap"])
            elif kind == "credit":
                self._output.credits.append((room, message["n"]))
            elif kind == "abort":
                self._output.aborted.append((room, message["reason"]))
                self._forget(room)
        return 0.0

    def after_step(self, sampled: dict[str, list[int]], now: float) -> float:
        """The step's blocks are copied out of the pool after its forward (the seconds returned)
        and leave then; the final message follows a room's last."""
        meta, self._meta = self._meta, PrefillMetadata()
        for request_id, room in meta.sampling.items():
            if request_id in sampled:
                self._first[room] = sampled[request_id][0]
        copy_s = sum(len(send.blocks) for send in meta.sends) * self.link.model.send_s_per_block
        now += copy_s
        for send in meta.sends:
            destination = send.peer.decode()
            self._started.setdefault(send.room, now)
            self.link.send(self.name, destination, now, {"t": "kv", "room": send.room, "n": len(send.blocks)},
                           len(send.blocks))
            self._output.bytes_sent += len(send.blocks) * self.link.block_bytes
            if send.final:
                token = self._first.pop(send.room, None)
                started = self._started.pop(send.room, now)
                if token is None:
                    message = {"t": "fail", "room": send.room, "reason": "the prefill step failed"}
                else:
                    message = {"t": "done", "room": send.room,
                               "first": FirstToken(token, None, None, send.num_cached_tokens)}
                self.link.send(self.name, destination, now, message)
                self._finished_sending.add(send.request_id)
                self._output.sent.append((send.request_id, 0, now - started))
        return copy_s

    def take_output(self) -> tuple[Any, set[str], set[str]]:
        """(the scheduler side's connector output, finished sending, finished receiving)."""
        output = self._output if self._output else None
        self._output = PrefillOutput()
        done, self._finished_sending = self._finished_sending, set()
        return output, done, set()

    def next_arrival(self) -> float | None:
        return self.link.next_arrival(self.name)

    def _forget(self, room: int) -> None:
        self._first.pop(room, None)
        self._started.pop(room, None)


@dataclass
class _Room:
    request_id: str
    source: str
    expected: int  # blocks to receive
    started: float
    received: int = 0
    first: FirstToken | None = None


class SimDecodeConnector:
    """The decode instance's worker side of the connector, over the simulated link."""

    def __init__(self, link: KVLink, name: str, window: int) -> None:
        self.link = link
        self.name = name
        self.window = window
        self._rooms: dict[int, _Room] = {}
        self._output = DecodeOutput()
        self._finished_recving: set[str] = set()

    def before_step(self, metadata: DecodeMetadata | None, now: float) -> float:
        """Drop and tell cancelled rooms, bootstrap new ones, take what arrived and copy its
        blocks into the pool (the seconds returned), then return the credit and report the rooms
        whose blocks and final message are all in."""
        meta = metadata or DecodeMetadata()
        for room_id, params in meta.cancelled.items():
            self._rooms.pop(room_id, None)
            self.link.send(self.name, prefill_name(params.port), now,
                           {"t": "abort", "room": room_id, "reason": "the request ended on the decode side"})
        for receive in meta.receives:
            source = prefill_name(receive.params.port)
            self._rooms[receive.params.room] = _Room(receive.request_id, source, len(receive.block_ids), now)
            self._output.bootstrapped.append(receive.request_id)
            bootstrap = Bootstrap(receive.params.room, self.name.encode(), receive.first_block,
                                  receive.first_block + len(receive.block_ids),
                                  min(self.window, len(receive.block_ids)), receive.prompt_digest)
            self.link.send(self.name, source, now, {"t": "bootstrap", "room": receive.params.room,
                                                    "bootstrap": bootstrap})
        arrived = self.link.take(self.name, now)
        copied = sum(m["n"] for m in arrived if m["t"] == "kv" and m["room"] in self._rooms)
        copy_s = copied * self.link.model.receive_s_per_block
        now += copy_s
        for message in arrived:
            room_id = message["room"]
            room = self._rooms.get(room_id)
            if room is None:
                self._output.late_messages += 1
                continue
            if message["t"] == "kv":
                if not room.received:
                    self._output.progress.append(room.request_id)
                room.received += message["n"]
                self._output.bytes_applied += message["n"] * self.link.block_bytes
                self.link.send(self.name, room.source, now, {"t": "credit", "room": room_id, "n": message["n"]})
            elif message["t"] == "done":
                room.first = message["first"]
            else:
                del self._rooms[room_id]
                self._output.failed.append((room.request_id, message["reason"]))
                continue
            if room.first is not None and room.received >= room.expected:
                del self._rooms[room_id]
                self._finished_recving.add(room.request_id)
                self._output.received.append((room.request_id, room.first, room.received * self.link.block_bytes,
                                              now - room.started))
        return copy_s

    def after_step(self, sampled: dict[str, list[int]], now: float) -> float:
        """(Nothing leaves a decode instance after its forward.)"""
        return 0.0

    def take_output(self) -> tuple[Any, set[str], set[str]]:
        output = self._output if self._output else None
        self._output = DecodeOutput()
        done, self._finished_recving = self._finished_recving, set()
        return output, set(), done

    def next_arrival(self) -> float | None:
        return self.link.next_arrival(self.name)

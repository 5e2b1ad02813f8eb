"""The decode instance's connector, worker side (its scheduler side: core/disagg/decode.py).

It owns one DEALER socket per prefill instance it receives from, with ZMTP heartbeats and a
monitor that reports a dropped connection. Everything happens at the start of a step, on the
engine thread, so no other Python thread competes with the step for the GIL:

  1. rooms whose requests ended here are dropped (their blocks may already be another
     request's: nothing of theirs is written any more) and their prefill side is told;
  2. new rooms are bootstrapped: this instance's model fingerprint (the prefill side refuses
     a different model or KV layout), the blocks it caches already, a window of credits;
  3. what arrived is taken from the sockets (a step that computes nothing waits a few ms for
     it), each block checked against its crc32, and copied into the pre-allocated blocks in
     one scatter; the credits go back, so the next blocks may travel;
  4. a room whose final message arrived and whose blocks are all in, with a digest that
     matches, is reported received with its first token; any failure (a bad block, a refused
     bootstrap, the prefill side gone or unreachable) is reported failed.
Every heartbeat interval each prefill instance with rooms in flight gets their lease renewed.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from chunkserve.config.kv_connector import KVConnectorConfig
from chunkserve.core.disagg.protocol import DecodeMetadata, DecodeOutput, FirstToken, Receive
from chunkserve.core.kv.layout import ModelFingerprint
from chunkserve.core.kv_connector import KVConnectorWorker
from chunkserve.worker.disagg.transport import IDLE_WAIT_S, block_digest, header, new_context, parse_header
from chunkserve.worker.kv_cache import write_blocks

logger = logging.getLogger(__name__)


@dataclass
class _Peer:
    endpoint: str
    socket: zmq.Socket
    monitor: zmq.Socket
    since: float  # when it was first used (or lost its connection)
    connected: bool = False
    last_hold: float = 0.0


@dataclass
class _Room:
    receive: Receive
    endpoint: str
    started: float
    crcs: dict[int, int] = field(default_factory=dict)  # block index -> crc32, of every block that arrived
    pending: list[tuple[int, memoryview]] = field(default_factory=list)  # (block index, payload) to copy in
    num_applied: int = 0
    returned: int = 0  # credits given back
    done: dict | None = None
    bytes: int = 0

    @property
    def num_expected(self) -> int:
        return len(self.receive.block_ids)


class DecodeConnectorWorker(KVConnectorWorker):
    def __init__(self, fingerprint: ModelFingerprint, window: int, heartbeat_interval: float,
                 heartbeat_max_failures: int) -> None:
        self.fingerprint = fingerprint
        self.block_size = fingerprint.layout.block_size
        self.window = window
        self.heartbeat_interval = heartbeat_interval
        self.dead_after = heartbeat_interval * heartbeat_max_failures
        self.kv_pool: torch.Tensor | None = None
        self._context = new_context()
        self._peers: dict[str, _Peer] = {}
        self._rooms: dict[int, _Room] = {}
        self._meta: DecodeMetadata | None = None
        self._finished_recving: set[str] = set()
        self._output = DecodeOutput()

    @classmethod
    def from_config(cls, config: KVConnectorConfig,
                    fingerprint: Callable[[], ModelFingerprint]) -> DecodeConnectorWorker:
        disaggregation = config.disaggregation
        return cls(fingerprint(), disaggregation.disaggregation_transfer_window,
                   disaggregation.disaggregation_heartbeat_interval,
                   disaggregation.disaggregation_heartbeat_max_failures)

    # ----- the worker's verbs --------------------------------------------------------------------

    def register_kv_caches(self, kv_pool: torch.Tensor) -> None:
        self.kv_pool = kv_pool

    def bind_connector_metadata(self, metadata: DecodeMetadata | None) -> None:
        self._meta = metadata

    def start_load_kv(self) -> None:
        meta, self._meta = self._meta or DecodeMetadata(), None
        now = time.monotonic()
        for room_id in meta.cancelled:  # first, before anything can fail: their blocks may be another's now
            self._rooms.pop(room_id, None)
        for room_id, params in meta.cancelled.items():
            if self._peer(params.endpoint, now) is not None:
                self._send(params.endpoint, header("abort", room=room_id, reason="the request ended on the decode side"))
        for receive in meta.receives:
            self._bootstrap(receive, now)
        self._watch_peers(now)
        self._receive(IDLE_WAIT_S if meta.idle and self._rooms else 0.0)
        self._apply()

    def get_finished(self, finished_request_ids: set[str]) -> tuple[set[str], set[str]]:
        done, self._finished_recving = self._finished_recving, set()
        return set(), done

    def take_connector_output(self) -> DecodeOutput | None:
        if not self._output:
            return None
        output, self._output = self._output, DecodeOutput()
        return output

    def shutdown(self) -> None:
        for peer in self._peers.values():
            peer.socket.disable_monitor()
            peer.monitor.close(linger=0)
            peer.socket.close(linger=0)
        self._peers.clear()
        self._context.term()

    # ----- rooms -----------------------------------------------------------------------------------------

    def _bootstrap(self, receive: Receive, now: float) -> None:
        endpoint = receive.params.endpoint
        peer = self._peer(endpoint, now)
        if peer is None:
            self._output.failed.append((receive.request_id, f"the prefill instance's address {endpoint} is not usable"))
            return
        room = _Room(receive, endpoint, now)
        self._rooms[receive.params.room] = room
        self._output.bootstrapped.append(receive.request_id)
        num_blocks = receive.first_block + len(receive.block_ids)
        self._send(peer.endpoint, header(
            "bootstrap", room=receive.params.room, fingerprint=self.fingerprint.to_dict(),
            first_block=receive.first_block, num_blocks=num_blocks, credits=min(self.window, len(receive.block_ids)),
            prompt_digest=receive.prompt_digest))

    def _fail(self, room_id: int, reason: str, tell_prefill: bool = True) -> None:
        room = self._rooms.pop(room_id, None)
        if room is None:
            return
        if tell_prefill:
            self._send(room.endpoint, header("abort", room=room_id, reason=reason))
        self._output.failed.append((room.receive.request_id, reason))

    def _receive(self, wait_s: float) -> None:
        if not self._peers:
            return
        if wait_s:
            poller = zmq.Poller()
            for peer in self._peers.values():
                poller.register(peer.socket, zmq.POLLIN)
            poller.poll(int(wait_s * 1000))
        for peer in list(self._peers.values()):
            while True:
                try:
                    frames = peer.socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    self._on_message(parse_header(frames[0].buffer), frames[1:])
                except Exception as error:  # whatever a peer sends, the engine goes on
                    logger.warning("dropped a malformed message from %s: %r", peer.endpoint, error)

    def _on_message(self, message: dict, payloads: list[zmq.Frame]) -> None:
        kind, room_id = message["t"], int(message["room"])
        room = self._rooms.get(room_id)
        if room is None:  # a room that ended here: late blocks are dropped (and counted)
            self._output.late_messages += 1
            return
        if kind == "fail":
            self._fail(room_id, f"the prefill instance failed it: {message['reason']}", tell_prefill=False)
        elif kind == "kv":
            first, crcs = int(message["first"]), [int(c) for c in message["crcs"]]
            if len(crcs) != len(payloads):
                raise ValueError("a KV message whose crc list does not match its payloads")
            for offset, (crc, frame) in enumerate(zip(crcs, payloads)):
                index = first + offset
                payload = frame.buffer
                local = index - room.receive.first_block
                if not 0 <= local < room.num_expected or len(payload) != self.fingerprint.layout.block_bytes:
                    self._fail(room_id, f"block {index} of room {room_id} does not fit the blocks it was given")
                    return
                if zlib.crc32(payload) != crc:
                    self._fail(room_id, f"block {index} of room {room_id} arrived corrupted (crc32 mismatch)")
                    return
                room.crcs[index] = crc
                room.pending.append((local, payload))
                room.bytes += len(payload)
            if room.num_applied == 0 and len(room.pending) == len(payloads):
                self._output.progress.append(room.receive.request_id)
        elif kind == "done":
            room.done = message

    def _apply(self) -> None:
        """Copy every arrived block into the pool (one scatter), return the credits, and finish
        the rooms that are complete."""
        block_ids, payloads = [], []
        for room in self._rooms.values():
            for local, payload in room.pending:
                block_ids.append(room.receive.block_ids[local])
                payloads.append(payload)
        if block_ids:
            write_blocks(self.kv_pool, block_ids, self.block_size, payloads)
            self._output.bytes_applied += sum(len(p) for p in payloads)
        for room_id, room in list(self._rooms.items()):
            if room.pending:
                room.num_applied += len(room.pending)
                room.pending = []
                if room.done is None:  # one credit per block copied in: at most `window` are ever in flight
                    self._send(room.endpoint, header("credit", room=room_id, n=room.num_applied - room.returned))
                    room.returned = room.num_applied
            if room.done is not None:
                self._complete(room_id, room)

    def _complete(self, room_id: int, room: _Room) -> None:
        done = room.done
        expected = [room.crcs.get(room.receive.first_block + i) for i in range(room.num_expected)]
        if None in expected or done.get("num_blocks") != room.num_expected:
            missing = expected.count(None)
            self._fail(room_id, f"{missing} of room {room_id}'s {room.num_expected} blocks never arrived", False)
            return
        if done.get("digest") != block_digest(expected):
            self._fail(room_id, f"room {room_id}'s digest does not match its blocks", tell_prefill=False)
            return
        try:
            first = FirstToken.from_wire(done["first_token"])
            layout_problem = self.fingerprint.mismatch(ModelFingerprint.from_dict(done["fingerprint"]))
            if int(done["prompt_len"]) != room.receive.prompt_len:
                layout_problem = f"the prefill instance computed {done['prompt_len']} prompt tokens, not " \
                                 f"{room.receive.prompt_len}"
        except Exception as error:
            self._fail(room_id, f"room {room_id}'s final message is malformed ({error!r})", tell_prefill=False)
            return
        if layout_problem is not None:
            self._fail(room_id, f"room {room_id}'s KV does not fit this instance: {layout_problem}", False)
            return
        del self._rooms[room_id]
        request_id = room.receive.request_id
        self._finished_recving.add(request_id)
        self._output.received.append((request_id, first, room.bytes, time.monotonic() - room.started))

    # ----- peers -----------------------------------------------------------------------------------------

    def _peer(self, endpoint: str, now: float) -> _Peer | None:
        """The connection to a prefill instance (made on first use); None when `endpoint` cannot be connected to."""
        peer = self._peers.get(endpoint)
        if peer is None:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.RCVHWM, 0)  # our credits bound what the prefill side sends
            socket.setsockopt(zmq.HEARTBEAT_IVL, int(self.heartbeat_interval * 1000))
            socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self.dead_after * 1000))
            monitor = socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            try:
                socket.connect(endpoint)
            except zmq.ZMQError as error:
                logger.warning("cannot connect to the prefill instance at %s: %s", endpoint, error)
                socket.disable_monitor()
                monitor.close(linger=0)
                socket.close(linger=0)
                return None
            peer = _Peer(endpoint, socket, monitor, now)
            self._peers[endpoint] = peer
        return peer

    def _send(self, endpoint: str, message: bytes) -> None:
        peer = self._peers.get(endpoint)
        if peer is not None:
            try:
                peer.socket.send(message, flags=zmq.NOBLOCK)
            except zmq.ZMQError as error:
                logger.warning("could not send to the prefill instance at %s: %s", endpoint, error)

    def _watch_peers(self, now: float) -> None:
        """Connections made and lost (the monitor), prefill instances never reached, lease renewals."""
        for peer in self._peers.values():
            while True:
                try:
                    event = recv_monitor_message(peer.monitor, flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                if event["event"] == zmq.EVENT_CONNECTED:
                    peer.connected = True
                elif event["event"] == zmq.EVENT_DISCONNECTED and peer.connected:
                    peer.connected, peer.since = False, now
                    self._fail_peer(peer, f"the connection to the prefill instance at {peer.endpoint} was lost")
            rooms = [room_id for room_id, room in self._rooms.items() if room.endpoint == peer.endpoint]
            if not rooms:
                peer.since = now
                continue
            if not peer.connected and now - peer.since > self.dead_after:
                peer.since = now
                self._fail_peer(peer, f"the prefill instance at {peer.endpoint} cannot be reached (no connection "
                                      f"within {self.dead_after:g} s)")
            elif now - peer.last_hold >= self.heartbeat_interval:
                peer.last_hold = now
                self._send(peer.endpoint, header("hold", room=0, rooms=rooms))

    def _fail_peer(self, peer: _Peer, reason: str) -> None:
        for room_id in [r for r, room in self._rooms.items() if room.endpoint == peer.endpoint]:
            self._fail(room_id, reason, tell_prefill=False)

"""The prefill instance's connector, worker side (its scheduler side: core/disagg/prefill.py).

It owns the ROUTER socket on the bootstrap port. At the start of every step (on the engine
thread) it takes what decode instances sent (bootstraps, after checking their KV layout and
model against this one's; credits; lease renewals; aborts) and tells decode sides of failed
rooms. After the step's sampling it copies the blocks the scheduler listed out of the pool
(one gather: they are final, this step's forward has written them), keeps each sampled
request's first token and generator state, and hands the messages to libzmq; the last
blocks of a room are followed by its final metadata message. Nothing it sends refers to the
pool afterwards, so the scheduler may free blocks as soon as they are listed.
"""

from __future__ import annotations

import logging
import time
import zlib
from collections import deque
from collections.abc import Callable

import torch
import zmq

from chunkserve.config.kv_connector import KVConnectorConfig
from chunkserve.core.disagg.protocol import Bootstrap, FirstToken, PrefillMetadata, PrefillOutput
from chunkserve.core.kv.layout import ModelFingerprint
from chunkserve.core.kv_connector import KVConnectorWorker
from chunkserve.core.messages import TokenLogprobs
from chunkserve.errors import InvalidRequestError
from chunkserve.worker.disagg.transport import (
    IDLE_WAIT_S,
    FaultInjector,
    block_digest,
    header,
    new_context,
    parse_header,
)
from chunkserve.worker.kv_cache import read_blocks

logger = logging.getLogger(__name__)


class PrefillConnectorWorker(KVConnectorWorker):
    def __init__(self, fingerprint: ModelFingerprint, host: str, port: int,
                 faults: FaultInjector | None = None) -> None:
        self.fingerprint = fingerprint
        self.block_size = fingerprint.layout.block_size
        self.faults = faults or FaultInjector()
        self.kv_pool: torch.Tensor | None = None
        self._context = new_context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a decode instance that is gone raises
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 0)  # the decode side's credits bound what is in flight
        try:
            self._socket.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as error:
            self.shutdown()
            raise InvalidRequestError(f"the disaggregation bootstrap port {host}:{port} cannot be bound: {error} "
                                      "(--disaggregation-bootstrap-port)") from None
        self.endpoint = self._socket.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._meta: PrefillMetadata | None = None
        self._sampled: dict[int, tuple[int, TokenLogprobs | None, bytes | None]] = {}  # room -> first token
        self._crcs: dict[int, list[int]] = {}  # room -> crc32 of every block sent so far
        self._started: dict[int, float] = {}
        self._outbox: deque[tuple[float, int, list, tuple[str, float] | None]] = deque()  # in order
        self._finished_sending: set[str] = set()
        self._output = PrefillOutput()
        logger.info("disaggregation: prefill bootstrap on %s", self.endpoint)

    @classmethod
    def from_config(cls, config: KVConnectorConfig,
                    fingerprint: Callable[[], ModelFingerprint]) -> PrefillConnectorWorker:
        disaggregation = config.disaggregation
        return cls(fingerprint(), disaggregation.disaggregation_bootstrap_host,
                   disaggregation.disaggregation_bootstrap_port, FaultInjector.from_env())

    # ----- the worker's verbs --------------------------------------------------------------------

    def register_kv_caches(self, kv_pool: torch.Tensor) -> None:
        self.kv_pool = kv_pool

    def bind_connector_metadata(self, metadata: PrefillMetadata | None) -> None:
        self._meta = metadata or PrefillMetadata()

    def start_load_kv(self) -> None:
        meta = self._meta or PrefillMetadata()
        for peer, room, reason in meta.fails:
            self._forget(room)
            if peer is not None:  # (None: no decode side ever asked for it)
                self._queue(room, [peer, header("fail", room=room, reason=reason)], delay=False)
        self._finished_sending |= meta.released
        self._flush()
        waiting = meta.idle and not meta.sends and not self._outbox
        self._receive(IDLE_WAIT_S if waiting else 0.0)

    def on_step_output(self, sampled_token_ids: dict[str, list[int]], logprobs: dict[str, list[TokenLogprobs]],
                       generator_state: Callable[[str], bytes | None]) -> None:
        meta, self._meta = self._meta or PrefillMetadata(), None
        for request_id, room in meta.sampling.items():
            tokens = sampled_token_ids.get(request_id)
            if tokens:
                token_logprobs = logprobs.get(request_id)
                self._sampled[room] = (tokens[0], token_logprobs[0] if token_logprobs else None,
                                       generator_state(request_id))
        if meta.sends:
            self._send_blocks(meta)
        self._flush()

    def get_finished(self, finished_request_ids: set[str]) -> tuple[set[str], set[str]]:
        done, self._finished_sending = self._finished_sending, set()
        return done, set()

    def take_connector_output(self) -> PrefillOutput | None:
        if not self._output:
            return None
        output, self._output = self._output, PrefillOutput()
        return output

    def shutdown(self) -> None:
        self._socket.close(linger=0)
        self._context.term()

    # ----- sending ------------------------------------------------------------------------------------

    def _send_blocks(self, meta: PrefillMetadata) -> None:
        block_ids = [block_id for send in meta.sends for _, block_id in send.blocks]
        payloads = read_blocks(self.kv_pool, block_ids, self.block_size)
        now = time.monotonic()
        offset = 0
        for send in meta.sends:
            chunk = payloads[offset: offset + len(send.blocks)]
            offset += len(send.blocks)
            crcs = [zlib.crc32(payload) for payload in chunk]
            self._crcs.setdefault(send.room, []).extend(crcs)
            self._started.setdefault(send.room, now)
            travelling = self.faults.apply(chunk)
            if travelling is not None:
                self._queue(send.room, [send.peer, header("kv", room=send.room, first=send.blocks[0][0], crcs=crcs),
                                        *travelling])
            self._output.bytes_sent += sum(map(len, chunk))
            if send.final:
                self._send_final(send, now)

    def _send_final(self, send, now: float) -> None:
        sampled = self._sampled.pop(send.room, None)
        crcs = self._crcs.pop(send.room, [])
        started = self._started.pop(send.room, now)
        if sampled is None:  # the step that sampled it failed: the decode side is told, not left waiting
            self._queue(send.room, [send.peer, header("fail", room=send.room, reason="the prefill step failed")],
                        sent=(send.request_id, started))
        else:
            token_id, token_logprobs, state = sampled
            first = FirstToken(token_id, token_logprobs, state, send.num_cached_tokens)
            self._queue(send.room, [send.peer, header(
                "done", room=send.room, request_id=send.request_id, num_blocks=len(crcs), digest=block_digest(crcs),
                prompt_len=send.prompt_len, fingerprint=self.fingerprint.to_dict(), first_token=first.to_wire())],
                sent=(send.request_id, started))

    def _queue(self, room: int, frames: list, delay: bool = True, sent: tuple[str, float] | None = None) -> None:
        """`sent`: (request id, when its first block went) once this is the final message, reported
        when it is handed to the socket."""
        ready = time.monotonic() + (self.faults.delay_s if delay else 0.0)
        self._outbox.append((ready, room, frames, sent))

    def _flush(self) -> None:
        """Hand ready messages to libzmq, in order; a decode instance that is gone ends its rooms."""
        now = time.monotonic()
        while self._outbox and self._outbox[0][0] <= now:
            _, room, frames, sent = self._outbox[0]
            try:
                self._socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return  # try again at the next step
            except zmq.ZMQError as error:  # EHOSTUNREACH: the peer disconnected
                self._output.aborted.append((room, f"the decode instance is unreachable ({error})"))
                self._forget(room)
            self._outbox.popleft()
            if sent is not None:  # the blocks it held may go (a copy of each is in the socket)
                request_id, started = sent
                self._finished_sending.add(request_id)
                self._output.sent.append((request_id, 0, now - started))

    def _forget(self, room: int) -> None:
        self._sampled.pop(room, None)
        self._crcs.pop(room, None)
        self._started.pop(room, None)

    # ----- receiving ----------------------------------------------------------------------------------

    def _receive(self, wait_s: float) -> None:
        if wait_s and not self._socket.poll(int(wait_s * 1000)):
            return
        output = self._output
        while True:
            try:
                peer, raw, *_ = self._socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = parse_header(raw)
                kind, room = message["t"], int(message.get("room", 0))
                if kind == "bootstrap":
                    problem = self._layout_problem(message.get("fingerprint"))
                    if problem is not None:
                        logger.warning("refused the bootstrap of room %d: %s", room, problem)
                        self._queue(room, [peer, header("fail", room=room, reason=problem)], delay=False)
                        output.aborted.append((room, problem))
                        continue
                    output.bootstraps.append(Bootstrap(room, peer, int(message["first_block"]),
                                                       int(message["num_blocks"]), int(message["credits"]),
                                                       str(message["prompt_digest"])))
                elif kind == "credit":
                    output.credits.append((room, int(message["n"])))
                elif kind == "hold":
                    output.leases.extend(int(r) for r in message["rooms"])
                elif kind == "abort":
                    output.aborted.append((room, str(message.get("reason", "aborted"))))
                    self._forget(room)
            except Exception as error:  # whatever a peer sends, the engine goes on
                logger.warning("dropped a malformed message from a decode instance: %r", error)

    def _layout_problem(self, raw: dict | None) -> str | None:
        try:
            theirs = ModelFingerprint.from_dict(raw)
        except (TypeError, KeyError):
            return "the decode instance sent no usable model fingerprint"
        problem = self.fingerprint.mismatch(theirs)
        if problem is None:
            return None
        return (f"the decode instance's model or KV layout does not match this prefill instance's: "
                f"{problem.replace('in the KV', 'on the decode instance')}")

"""Prefill/decode disaggregation, the workers' sides (worker/disagg/): KV blocks moving between
two small random pools over real zmq sockets on 127.0.0.1, each worker stepped by hand with
the metadata its scheduler side would send (bind_connector_metadata, start_load_kv,
on_step_output, get_finished, take_connector_output), as the model runner calls them."""

from __future__ import annotations

import random
import time
from contextlib import contextmanager

import pytest
import torch

from chunkserve.core.disagg.protocol import (
    BlockSend,
    Bootstrap,
    DecodeMetadata,
    FirstToken,
    PrefillMetadata,
    Receive,
    TransferParams,
    prompt_digest,
)
from chunkserve.core.kv.layout import KVLayout, ModelFingerprint
from chunkserve.core.messages import TokenLogprobs
from chunkserve.errors import InvalidRequestError
from chunkserve.worker.disagg.decode import DecodeConnectorWorker
from chunkserve.worker.disagg.prefill import PrefillConnectorWorker
from chunkserve.worker.disagg.transport import FaultInjector
from chunkserve.worker.kv_cache import read_blocks

BLOCK, LAYERS, HEAD_DIM = 4, 2, 8
INTERVAL, MAX_FAILURES = 0.2, 2
DEAD_WINDOW = INTERVAL * MAX_FAILURES + 1.0  # a dead or unreachable prefill instance shows within this
NUM_BLOCKS = 16
PROMPT = list(range(100, 122))  # 22 tokens: 6 blocks, the last one holding 2
SENTINEL = 12345.0


def fingerprint(kv_heads: int = 2, block_size: int = BLOCK, dtype: str = "float32",
                weights: str = "a" * 64) -> ModelFingerprint:
    return ModelFingerprint(weights, "b" * 64, KVLayout(dtype, LAYERS, kv_heads, HEAD_DIM, block_size))


def random_pool(kv_heads: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 2, NUM_BLOCKS * BLOCK, kv_heads, HEAD_DIM, generator=generator)


def fill(pool: torch.Tensor, block_ids: list[int], value: float) -> None:
    for block_id in block_ids:
        pool[:, :, block_id * BLOCK:(block_id + 1) * BLOCK] = value


def holds_sentinel(pool: torch.Tensor, block_ids: list[int]) -> bool:
    return all(bool((pool[:, :, b * BLOCK:(b + 1) * BLOCK] == SENTINEL).all()) for b in block_ids)


class Pair:
    """A prefill and a decode worker over real zmq, stepped as their engines would step them;
    everything they report is gathered here."""

    def __init__(self, window: int, faults: FaultInjector | None, kv_heads: int,
                 decode_fingerprint: ModelFingerprint | None) -> None:
        self.prefill_alive = False
        self.decode = None
        self.prefill = PrefillConnectorWorker(fingerprint(kv_heads), "127.0.0.1", 0, faults)
        self.prefill_alive = True
        self.port = int(self.prefill.endpoint.rsplit(":", 1)[1])
        self.decode = DecodeConnectorWorker(decode_fingerprint or fingerprint(kv_heads), window, INTERVAL,
                                            MAX_FAILURES)
        self.prefill_pool, self.decode_pool = random_pool(kv_heads, 1), random_pool(kv_heads, 2)
        self.prefill.register_kv_caches(self.prefill_pool)
        self.decode.register_kv_caches(self.decode_pool)
        self.block_bytes = fingerprint(kv_heads).layout.block_bytes
        self.bootstraps: list[Bootstrap] = []
        self.credits: list[tuple[int, int]] = []
        self.leases: list[int] = []
        self.aborted: list[tuple[int, str]] = []
        self.sent: list[str] = []
        self.finished_sending: set[str] = set()
        self.received: list[tuple[str, FirstToken, int]] = []
        self.failed: list[tuple[str, str]] = []
        self.progress: list[str] = []
        self.finished_recving: set[str] = set()
        self.bytes_applied = 0

    def close(self) -> None:
        if self.decode is not None:
            self.decode.shutdown()
        if self.prefill_alive:
            self.kill_prefill()

    def kill_prefill(self) -> None:
        self.prefill.shutdown()
        self.prefill_alive = False

    def step_prefill(self, meta: PrefillMetadata | None = None, sampled: dict | None = None,
                     logprobs: dict | None = None, generator_state=None) -> None:
        prefill = self.prefill
        prefill.bind_connector_metadata(meta or PrefillMetadata(idle=True))
        prefill.start_load_kv()
        prefill.on_step_output(sampled or {}, logprobs or {}, generator_state or (lambda request_id: None))
        sending, _ = prefill.get_finished(set())
        self.finished_sending |= sending
        output = prefill.take_connector_output()
        if output is not None:
            self.bootstraps += output.bootstraps
            self.credits += output.credits
            self.leases += output.leases
            self.aborted += output.aborted
            self.sent += [request_id for request_id, _, _ in output.sent]

    def step_decode(self, meta: DecodeMetadata | None = None) -> None:
        decode = self.decode
        decode.bind_connector_metadata(meta or DecodeMetadata(idle=True))
        decode.start_load_kv()
        decode.on_step_output({}, {}, lambda request_id: None)
        _, recving = decode.get_finished(set())
        self.finished_recving |= recving
        output = decode.take_connector_output()
        if output is not None:
            self.received += [(request_id, first, size) for request_id, first, size, _ in output.received]
            self.failed += output.failed
            self.progress += output.progress
            self.bytes_applied += output.bytes_applied

    def pump(self, until, timeout: float = 3.0, prefill: bool = True) -> float:
        """Step both sides until `until()` holds; returns the seconds it took."""
        start = time.monotonic()
        while not until():
            assert time.monotonic() - start < timeout, "timed out"
            if prefill and self.prefill_alive:
                self.step_prefill()
            self.step_decode()
            time.sleep(0.001)
        return time.monotonic() - start

    def settle(self, seconds: float = 0.3) -> None:
        end = time.monotonic() + seconds
        self.pump(lambda: time.monotonic() > end, timeout=seconds + 1)

    def start_room(self, request_id: str, room: int, first_block: int, block_ids: list[int],
                   prompt: list[int] = PROMPT) -> Bootstrap:
        """The decode side asks for the room; returns the bootstrap as the prefill side got it."""
        receive = Receive(request_id, TransferParams(room, "127.0.0.1", self.port), first_block, list(block_ids),
                          prompt_digest(prompt), len(prompt))
        self.step_decode(DecodeMetadata(receives=[receive]))
        self.pump(lambda: any(b.room == room for b in self.bootstraps))
        return next(b for b in self.bootstraps if b.room == room)

    def take_credits(self, room: int) -> int:
        mine = sum(n for r, n in self.credits if r == room)
        self.credits = [(r, n) for r, n in self.credits if r != room]
        return mine


@contextmanager
def pair(window: int = 16, faults: FaultInjector | None = None, kv_heads: int = 2,
         decode_fingerprint: ModelFingerprint | None = None):
    workers = None
    try:
        workers = Pair(window, faults, kv_heads, decode_fingerprint)
        yield workers
    finally:
        if workers is not None:
            workers.close()


def send_all(p: Pair, request_id: str, room: int, peer: bytes, src: list[int], first_block: int = 0,
             token: int = 5) -> None:
    """One prefill step that completes the prompt: every block from `first_block` and the first token."""
    blocks = [(i, src[i]) for i in range(first_block, len(src))]
    p.step_prefill(PrefillMetadata(sends=[BlockSend(request_id, room, peer, blocks, True, len(PROMPT), 0)],
                                   sampling={request_id: room}), sampled={request_id: [token]})


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_the_missing_blocks_land_byte_identical_with_the_first_token(kv_heads):
    """A disaggregated request's KV on the decode instance is exactly the prefill instance's:
    only the blocks past the decode side's cached ones travel (the partial last block included),
    into the blocks the decode scheduler pre-allocated and nowhere else; the final message
    brings the first token, its logprobs and the seeded generator's state unchanged."""
    with pair(kv_heads=kv_heads) as p:
        src = [4, 7, 1, 10, 2, 8]  # the prefill instance's block table
        dst = [9, 3, 12, 5]  # the decode instance's blocks for prompt blocks 2..5
        before = p.decode_pool.clone()
        boot = p.start_room("r", 101, 2, dst)
        assert (boot.first_block, boot.num_blocks, boot.credits, boot.prompt_digest) == (2, 6, 4, prompt_digest(PROMPT))
        logprobs = TokenLogprobs(17, -0.123456789, [(17, -0.123456789), (3, -2.5)])
        state = bytes(range(256)) * 3
        # a chunk completes blocks 2-3; the next step completes the prompt: blocks 4-5 and the first token
        p.step_prefill(PrefillMetadata(sends=[BlockSend("r", 101, boot.peer, [(2, src[2]), (3, src[3])])]))
        p.step_prefill(PrefillMetadata(sends=[BlockSend("r", 101, boot.peer, [(4, src[4]), (5, src[5])], final=True,
                                                        prompt_len=22, num_cached_tokens=4)], sampling={"r": 101}),
                       sampled={"r": [17]}, logprobs={"r": [logprobs]},
                       generator_state=lambda request_id: state if request_id == "r" else None)
        assert p.finished_sending == {"r"} and p.sent == ["r"]
        p.pump(lambda: "r" in p.finished_recving)
        assert read_blocks(p.decode_pool, dst, BLOCK) == read_blocks(p.prefill_pool, src[2:], BLOCK)
        others = [b for b in range(NUM_BLOCKS) if b not in dst]
        assert read_blocks(p.decode_pool, others, BLOCK) == read_blocks(before, others, BLOCK)
        [(request_id, first, size)] = p.received
        assert request_id == "r" and size == 4 * p.block_bytes
        assert first == FirstToken(17, logprobs, state, 4)
        assert p.failed == [] and p.progress == ["r"] and p.bytes_applied == 4 * p.block_bytes


def test_credits_keep_at_most_the_window_in_flight():
    """A long prompt's KV cannot pile up in socket buffers: the decode side grants `window`
    blocks and one more credit per block it copied into its pool; listing within those credits
    (as the prefill scheduler does), the transfer completes, all 7 blocks identical."""
    prompt = list(range(200, 226))  # 26 tokens: 7 blocks
    with pair(window=2) as p:
        src, dst = [0, 2, 4, 6, 8, 10, 12], [15, 14, 13, 11, 9, 7, 5]
        boot = p.start_room("r", 102, 0, dst, prompt=prompt)
        assert boot.credits == 2
        credits = granted = boot.credits
        listed = rounds = 0
        start = time.monotonic()
        while "r" not in p.finished_recving:
            assert time.monotonic() - start < 3, "the transfer stalled"
            count = min(credits, 7 - listed)
            if count:
                blocks = [(i, src[i]) for i in range(listed, listed + count)]
                listed += count
                credits -= count
                rounds += 1
                final = listed == 7
                p.step_prefill(PrefillMetadata(sends=[BlockSend("r", 102, boot.peer, blocks, final, 26, 0)],
                                               sampling={"r": 102} if final else {}), sampled={"r": [9]})
            else:
                p.step_prefill()
            returned = p.take_credits(102)
            credits += returned
            granted += returned
            p.step_decode()
            applied = p.bytes_applied // p.block_bytes
            assert granted <= applied + 2, "the decode side granted more than its window past what it applied"
            assert listed - applied <= 2
            time.sleep(0.001)
        assert rounds >= 4
        assert read_blocks(p.decode_pool, dst, BLOCK) == read_blocks(p.prefill_pool, src, BLOCK)


def test_a_room_in_flight_renews_its_lease():
    """While a transfer waits (a long prompt computing), the decode side renews its hold every
    heartbeat interval, so the prefill side does not release the KV as abandoned."""
    with pair() as p:
        p.start_room("r", 103, 0, [1, 2, 3, 4, 5, 6])
        p.leases.clear()
        p.settle(3 * INTERVAL + 0.1)
        assert p.leases.count(103) >= 2 and p.failed == []


@pytest.mark.parametrize("mode, expected", [("corrupt", "crc32"), ("drop", "never arrived")])
def test_a_damaged_or_lost_transfer_fails_and_nothing_of_it_is_received(mode, expected):
    """A block damaged on the way (its crc32 differs) or a message lost fails the request
    instead of decoding over wrong KV; nothing of it is reported received or copied in."""
    faults = FaultInjector(fail_prob=1.0, mode=mode, rng=random.Random(0))
    with pair(faults=faults) as p:
        src, dst = [0, 1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15]
        fill(p.decode_pool, dst, SENTINEL)
        boot = p.start_room("r", 104, 0, dst)
        send_all(p, "r", 104, boot.peer, src)
        p.pump(lambda: p.failed)
        [(request_id, reason)] = p.failed
        assert request_id == "r" and expected in reason
        p.settle()
        assert p.received == [] and p.finished_recving == set() and p.bytes_applied == 0
        assert holds_sentinel(p.decode_pool, dst)


@pytest.mark.parametrize("decode_fingerprint, expected", [
    (fingerprint(block_size=8), "block_size"),
    (fingerprint(dtype="bfloat16"), "dtype"),
    (fingerprint(weights="c" * 64), "weights hash"),
], ids=["block_size", "dtype", "weights"])
def test_a_decode_instance_of_another_model_or_layout_is_refused(decode_fingerprint, expected):
    """KV is only ever read by the model and layout that wrote it: the prefill side refuses
    the bootstrap, the decode side fails the request naming the difference, and the prefill
    side reports the room aborted (its request fails there too)."""
    with pair(decode_fingerprint=decode_fingerprint) as p:
        receive = Receive("r", TransferParams(105, "127.0.0.1", p.port), 0, [1, 2, 3, 4, 5, 6], prompt_digest(PROMPT),
                          len(PROMPT))
        p.step_decode(DecodeMetadata(receives=[receive]))
        p.pump(lambda: p.failed and p.aborted)
        [(request_id, reason)] = p.failed
        assert request_id == "r" and expected in reason and "decode instance" in reason
        assert [room for room, _ in p.aborted] == [105] and expected in p.aborted[0][1]
        assert p.bootstraps == []


def test_a_cancelled_rooms_late_blocks_are_never_written():
    """An aborted request's blocks may already be another request's: once the decode side
    dropped the room, blocks the prefill side still sends for it are never copied in, and the
    prefill side hears of the abort."""
    with pair() as p:
        src, dst = [0, 1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15]
        fill(p.decode_pool, dst, SENTINEL)
        boot = p.start_room("r", 106, 0, dst)
        p.step_decode(DecodeMetadata(cancelled={106: TransferParams(106, "127.0.0.1", p.port)}))
        send_all(p, "r", 106, boot.peer, src)
        p.pump(lambda: any(room == 106 for room, _ in p.aborted))
        p.settle()
        assert holds_sentinel(p.decode_pool, dst)
        assert p.received == [] and p.failed == [] and p.progress == [] and p.bytes_applied == 0


def test_a_decode_instance_that_is_gone_ends_the_room_on_the_prefill_side():
    """Sending to a decode instance that went away reports its room aborted, so the prefill
    side frees the request's KV at once instead of holding it until the lease runs out."""
    with pair() as p:
        boot = p.start_room("r", 109, 0, [10, 11, 12, 13, 14, 15])
        p.decode.shutdown()
        p.decode = None
        start = time.monotonic()
        while not p.aborted:
            assert time.monotonic() - start < 2, "the prefill side never noticed"
            p.step_prefill(PrefillMetadata(sends=[BlockSend("r", 109, boot.peer, [(0, 0)])]))
            time.sleep(0.005)
        assert [room for room, _ in p.aborted][:1] == [109] and "unreachable" in p.aborted[0][1]


def test_a_prefill_instance_that_dies_mid_transfer_fails_the_room_quickly():
    """The prefill instance going away (its socket closed) fails the requests whose KV it was
    sending within the heartbeat window, instead of leaving them waiting for their timeout."""
    with pair() as p:
        src, dst = [0, 1, 2, 3, 4, 5], [10, 11, 12, 13, 14, 15]
        boot = p.start_room("r", 107, 0, dst)
        p.step_prefill(PrefillMetadata(sends=[BlockSend("r", 107, boot.peer, [(0, src[0]), (1, src[1])])]))
        p.pump(lambda: "r" in p.progress)
        p.kill_prefill()
        took = p.pump(lambda: p.failed, timeout=DEAD_WINDOW + 1, prefill=False)
        assert took <= DEAD_WINDOW
        [(request_id, reason)] = p.failed
        assert request_id == "r" and "prefill instance" in reason and p.received == []


def test_an_unreachable_prefill_instance_fails_the_room_quickly():
    """A prefill endpoint nobody listens on fails the request within the heartbeat window."""
    with pair() as p:
        port = p.port
        p.kill_prefill()  # its port is free now: nothing listens there
        receive = Receive("r", TransferParams(108, "127.0.0.1", port), 0, [1, 2], prompt_digest(PROMPT[:8]), 8)
        p.step_decode(DecodeMetadata(receives=[receive]))
        took = p.pump(lambda: p.failed, timeout=DEAD_WINDOW + 1, prefill=False)
        assert INTERVAL * MAX_FAILURES - 0.05 <= took <= DEAD_WINDOW
        [(request_id, reason)] = p.failed
        assert request_id == "r" and "cannot be reached" in reason


def test_binding_a_port_in_use_names_the_port():
    """Two prefill instances on one bootstrap port: the second refuses to start, naming it."""
    with pair() as p:
        second = None
        try:
            with pytest.raises(InvalidRequestError) as raised:
                second = PrefillConnectorWorker(fingerprint(), "127.0.0.1", p.port)
        finally:
            if second is not None:
                second.shutdown()
        assert f"127.0.0.1:{p.port}" in str(raised.value)

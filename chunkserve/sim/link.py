"""The wire between a simulated prefill instance and a decode instance: how long a message of
KV blocks takes to arrive and what moving a block costs each instance's engine thread, and a
measurement of the real ones (the disaggregation connector's own transport and copies).

A message of n bytes sent at t arrives at max(t, the link's last arrival) + latency + n / rate:
one link per (prefill, decode) pair carries its messages in order, one after another, as one
TCP connection does. The engine threads copy blocks out of the pool (the prefill side, after
the forward of the step that lists them) and into it (the decode side, before its next step's
forward): those seconds lengthen the steps they happen in.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chunkserve.errors import InvalidRequestError

if TYPE_CHECKING:
    from chunkserve.model.config import ModelConfig


@dataclass(frozen=True)
class LinkModel:
    bytes_per_s: float
    latency_s: float = 0.0
    send_s_per_block: float = 0.0  # the prefill engine thread's copy of a block out of its pool
    receive_s_per_block: float = 0.0  # the decode engine thread's copy of a block into its pool

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0:
            raise InvalidRequestError(f"the KV link's rate must be positive, got {self.bytes_per_s} bytes/s")
        for name in ("latency_s", "send_s_per_block", "receive_s_per_block"):
            if not getattr(self, name) >= 0:
                raise InvalidRequestError(f"the KV link's {name} must be >= 0, got {getattr(self, name)}")

    def describe(self) -> str:
        return (f"{self.bytes_per_s * 8 / 1e9:.2f} Gbit/s, {self.latency_s * 1e6:.0f} us; copies "
                f"{self.send_s_per_block * 1e3:.3f} / {self.receive_s_per_block * 1e3:.3f} ms a block out / in")


def measure_link(block_bytes: int, model_config: ModelConfig | None = None, dtype: str = "float32",
                 block_size: int = 16, blocks_per_message: int = 16, messages: int = 64, pings: int = 200,
                 repeats: int = 5) -> LinkModel:
    """The disaggregation transport's rate and one-way latency on this host's loopback: a ZMQ
    ROUTER/DEALER pair as the connector sets it up, blocks of `block_bytes` sent as its KV
    messages are (a JSON header, one frame per block). Latency: half the median round trip
    of a header alone; rate: the bytes of `messages` messages over the time to receive them all.
    With `model_config`, the connector's block copies out of and into a KV pool of that model at
    `dtype` are timed too (medians of `repeats`)."""
    import zmq

    from chunkserve.worker.disagg.transport import header, new_context

    context = new_context()
    router, dealer = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
    try:
        router.setsockopt(zmq.SNDHWM, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(header("hello"))
        peer, _ = router.recv_multipart()
        round_trips = []
        for _ in range(pings):
            started = time.perf_counter()
            router.send_multipart([peer, header("ping", room=0)])
            dealer.recv()
            dealer.send(header("pong", room=0))
            router.recv_multipart()
            round_trips.append(time.perf_counter() - started)
        payloads = [bytes(block_bytes)] * blocks_per_message
        started = time.perf_counter()
        for index in range(messages):
            router.send_multipart([peer, header("kv", room=index, first=0), *payloads], copy=False)
        for _ in range(messages):
            dealer.recv_multipart(copy=False)
        elapsed = time.perf_counter() - started
    finally:
        router.close(linger=0)
        dealer.close(linger=0)
        context.term()
    latency = statistics.median(round_trips) / 2
    send_s = receive_s = 0.0
    if model_config is not None:
        send_s, receive_s = _copy_seconds(model_config, dtype, block_size, blocks_per_message * 8, repeats)
    return LinkModel(block_bytes * blocks_per_message * messages / elapsed, latency, send_s, receive_s)


def _copy_seconds(model_config: ModelConfig, dtype: str, block_size: int, blocks: int,
                  repeats: int) -> tuple[float, float]:
    """Seconds per block of the connector's gather out of a pool and scatter into it."""
    from chunkserve.model.loader import TORCH_DTYPES
    from chunkserve.worker.kv_cache import allocate_kv_pool, read_blocks, write_blocks

    pool = allocate_kv_pool(model_config, TORCH_DTYPES[dtype], 2 * blocks, block_size)
    sources, targets = list(range(blocks)), list(range(blocks, 2 * blocks))
    reads, writes = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        payloads = read_blocks(pool, sources, block_size)
        reads.append(time.perf_counter() - started)
        started = time.perf_counter()
        write_blocks(pool, targets, block_size, payloads)
        writes.append(time.perf_counter() - started)
    return statistics.median(reads) / blocks, statistics.median(writes) / blocks

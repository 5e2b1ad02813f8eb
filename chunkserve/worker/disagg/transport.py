"""The wire between a prefill and a decode instance: pyzmq over TCP (libzmq moves the bytes on
its own I/O thread, outside the GIL; the engine thread only hands messages over and takes them
between steps).

The prefill instance binds a ROUTER socket on its bootstrap port; each decode instance
connects one DEALER per prefill instance it receives from. Every message is a JSON header
frame, then any block payloads (one frame each, `KVLayout.block_bytes`):

  decode -> prefill  bootstrap {room, fingerprint, first_block, num_blocks, credits, prompt_digest}
                     credit {room, n}       blocks copied into the pool: n more may travel
                     hold {rooms}           lease renewal, every heartbeat interval
                     abort {room, reason}   the decode side gave the room up
  prefill -> decode  kv {room, first, crcs} + payloads: blocks first.. of the prompt
                     done {room, num_blocks, digest, first_token, prompt_len}: the final metadata
                     fail {room, reason}

Liveness: ZMTP heartbeats on the decode side's connections (answered by libzmq itself, so a
prefill instance busy in a long step still answers) and a socket monitor that reports a
dropped connection; a prefill instance killed outright resets its TCP connections at once.

Fault injection for tests (read once per process): CHUNKSERVE_PD_FAIL_PROB (fraction of KV
messages hit), CHUNKSERVE_PD_FAULT (`corrupt`, the default: one byte of a payload flipped after
its crc32 was taken; or `drop`: the message is not sent), CHUNKSERVE_PD_DELAY_MS (every message
from the prefill side leaves that much later), CHUNKSERVE_PD_FAULT_SEED.
"""

from __future__ import annotations

import json
import os
import random
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import zmq

IDLE_WAIT_S = 0.005  # a step that computes nothing waits this long for a message instead of spinning


def header(kind: str, **fields: Any) -> bytes:
    return json.dumps({"t": kind, **fields}, separators=(",", ":")).encode()


def parse_header(frame: bytes | memoryview) -> dict[str, Any]:
    return json.loads(bytes(frame))


def block_digest(crcs: list[int]) -> str:
    """The final message's digest: every block's crc32, in order (so a missing or reordered block shows)."""
    return format(zlib.crc32(struct.pack(f"<{len(crcs)}I", *crcs)), "08x")


def new_context() -> zmq.Context:
    """A context of the connector's own (one I/O thread), so its sockets close with it."""
    return zmq.Context(io_threads=1)


@dataclass(frozen=True)
class FaultInjector:
    fail_prob: float = 0.0
    mode: str = "corrupt"
    delay_s: float = 0.0
    rng: random.Random | None = None

    @classmethod
    def from_env(cls) -> FaultInjector:
        prob = float(os.environ.get("CHUNKSERVE_PD_FAIL_PROB", "0") or 0)
        mode = os.environ.get("CHUNKSERVE_PD_FAULT", "corrupt") or "corrupt"
        if mode not in ("corrupt", "drop"):
            raise ValueError(f"CHUNKSERVE_PD_FAULT must be corrupt or drop, got {mode!r}")
        delay = float(os.environ.get("CHUNKSERVE_PD_DELAY_MS", "0") or 0) / 1000
        seed = os.environ.get("CHUNKSERVE_PD_FAULT_SEED")
        return cls(prob, mode, delay, random.Random(None if seed is None else int(seed)))

    @property
    def active(self) -> bool:
        return self.fail_prob > 0 or self.delay_s > 0

    def apply(self, payloads: list[bytes]) -> list[bytes] | None:
        """The payloads as they will travel: None when the message is dropped."""
        if self.fail_prob <= 0 or not payloads or self.rng.random() >= self.fail_prob:
            return payloads
        if self.mode == "drop":
            return None
        damaged = bytearray(payloads[0])
        damaged[self.rng.randrange(len(damaged))] ^= 0xFF
        return [bytes(damaged), *payloads[1:]]

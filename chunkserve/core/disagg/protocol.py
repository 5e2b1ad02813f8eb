"""What the two sides of a disaggregation connector tell each other inside one engine (the
scheduler's side in its step metadata, the worker's side in its output), and what a request
carries to say where its KV comes from or goes to.

A transfer is named by its *room*: a random 63-bit number the router gives both copies of
one request (SGLang's `bootstrap_room`). A room is one request, never a reusable slot.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from chunkserve.core.messages import TokenLogprobs

if TYPE_CHECKING:  # request.py imports this module's TransferParams
    from chunkserve.core.request import Request

MAX_ROOM = 2**63 - 1


@dataclass(frozen=True)
class TransferParams:
    """The router's pairing of a request: its room and the prefill instance's bootstrap address."""

    room: int
    host: str
    port: int

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port}"


def prompt_digest(token_ids: list[int]) -> str:
    """Both instances must have tokenized the same prompt (same tokenizer, same chat template)."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:32]


@dataclass
class FirstToken:
    """The prefill side's sample and the state the decode side continues from."""

    token_id: int
    logprobs: TokenLogprobs | None
    generator_state: bytes | None  # a seeded request's generator after the first draw
    num_cached_tokens: int  # prompt tokens the prefill side found in its prefix cache

    def continue_as_decode(self, request: Request) -> None:
        """The decode side's request takes the first token and the state after it, as if it had
        sampled it itself."""
        request.output_token_ids.append(self.token_id)
        request.generator_state = self.generator_state
        request.num_cached_tokens = self.num_cached_tokens

    def to_wire(self) -> dict[str, Any]:
        logprobs = None if self.logprobs is None else [self.logprobs.token_id, self.logprobs.logprob,
                                                       [list(t) for t in self.logprobs.top], self.logprobs.rank]
        return {"token_id": self.token_id, "logprobs": logprobs, "num_cached_tokens": self.num_cached_tokens,
                "generator_state": None if self.generator_state is None else self.generator_state.hex()}

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> FirstToken:
        logprobs = raw["logprobs"]
        if logprobs is not None:
            rank = logprobs[3]
            logprobs = TokenLogprobs(int(logprobs[0]), float(logprobs[1]), [(int(t), float(p)) for t, p in logprobs[2]],
                                     None if rank is None else int(rank))
        state = raw["generator_state"]
        return cls(int(raw["token_id"]), logprobs, None if state is None else bytes.fromhex(state),
                   int(raw["num_cached_tokens"]))


# ----- prefill: scheduler side -> worker side ------------------------------------------------------

@dataclass
class BlockSend:
    """Blocks of one request to push to its decode peer after this step's forward: (index in the
    request's block table, block id), in order; `final` once they are the last (the partial last
    block included): the worker then sends the metadata message with the first token."""

    request_id: str
    room: int
    peer: bytes
    blocks: list[tuple[int, int]]
    final: bool = False
    prompt_len: int = 0
    num_cached_tokens: int = 0


@dataclass
class PrefillMetadata:
    sends: list[BlockSend] = field(default_factory=list)
    sampling: dict[str, int] = field(default_factory=dict)  # request id -> room: keep its first token
    fails: list[tuple[bytes | None, int, str]] = field(default_factory=list)  # (peer, room, why): ended rooms
    released: set[str] = field(default_factory=set)  # finished requests whose held blocks may go
    idle: bool = False  # the step computes nothing: the worker may wait a little for messages


@dataclass
class Bootstrap:
    """A decode instance asked for a room's KV: it holds the first `first_block` blocks already
    (its prefix cache) and grants `credits` blocks in flight."""

    room: int
    peer: bytes
    first_block: int
    num_blocks: int
    credits: int
    prompt_digest: str


@dataclass
class PrefillOutput:
    bootstraps: list[Bootstrap] = field(default_factory=list)
    credits: list[tuple[int, int]] = field(default_factory=list)  # (room, blocks)
    leases: list[int] = field(default_factory=list)  # rooms whose decode side renewed its hold
    aborted: list[tuple[int, str]] = field(default_factory=list)  # (room, why): the decode side gave up
    sent: list[tuple[str, int, float]] = field(default_factory=list)  # (request id, bytes, seconds): all out
    bytes_sent: int = 0

    def __bool__(self) -> bool:
        return bool(self.bootstraps or self.credits or self.leases or self.aborted or self.sent or self.bytes_sent)


# ----- decode: scheduler side -> worker side -------------------------------------------------------

@dataclass
class Receive:
    """Ask the prefill instance for a room's KV: blocks `first_block`.. of the prompt land in
    `block_ids` (one per block from `first_block` on, the partial last block included)."""

    request_id: str
    params: TransferParams
    first_block: int
    block_ids: list[int]
    prompt_digest: str
    prompt_len: int


@dataclass
class DecodeMetadata:
    receives: list[Receive] = field(default_factory=list)
    cancelled: dict[int, TransferParams] = field(default_factory=dict)  # ended here: drop, tell the prefill side
    idle: bool = False


@dataclass
class DecodeOutput:
    received: list[tuple[str, FirstToken, int, float]] = field(default_factory=list)  # (id, first, bytes, s)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (request id, why)
    progress: list[str] = field(default_factory=list)  # requests whose first bytes arrived
    bootstrapped: list[str] = field(default_factory=list)  # requests whose prefill side was asked
    bytes_applied: int = 0
    late_messages: int = 0  # messages for rooms that had already ended here: dropped

    def __bool__(self) -> bool:  # (any of it changes the stats: the engine reports them)
        return bool(self.received or self.failed or self.progress or self.bootstrapped or self.bytes_applied
                    or self.late_messages)

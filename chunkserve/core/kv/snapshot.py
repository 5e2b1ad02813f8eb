"""`RequestSnapshot`: a running request and its KV, portable to another engine.

Everything needed to continue a request elsewhere exactly as it would have continued here:
its tokens and how many have KV (`num_computed_tokens`), its sampling parameters and its own
generator's state (a seeded stream continues draw for draw), the frontend's detokenizer and
stop-string state (a stream resumes without repeating or dropping a character), its arrival
time, priority and metrics, and the KV of its computed tokens: each full block with its
prefix-cache hash (the SHA-256 chain over its tokens) and a crc32, then the partial last block
by value. A block's payload may be left out when the destination is known to cache it.

On the wire: `MAGIC`, the format version (u32), the header's length (u64), the header (JSON),
then the payloads back to back. `verify` checks a snapshot against the importing engine before
anything is allocated: format version, model fingerprint, that the block hashes are those of
its tokens (so a tampered snapshot cannot poison the prefix cache), payload sizes and crc32s.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import struct
import zlib
from dataclasses import dataclass, field

from chunkserve.core.kv.kv_cache_manager import hash_block, root_hash
from chunkserve.core.kv.layout import ModelFingerprint
from chunkserve.errors import InvalidRequestError
from chunkserve.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

MAGIC = b"CHUNKSNAP"
FORMAT_VERSION = 1
_PREAMBLE = struct.Struct("<IQ")  # format version, header length


class SnapshotError(InvalidRequestError):
    """A snapshot this engine cannot take: malformed, tampered or from another model."""


@dataclass
class SnapshotBlock:
    """One block of the request's computed KV. `block_hash` is None for the partial last block;
    `payload` is None when it was left out (the destination must cache the block)."""

    block_hash: bytes | None
    crc32: int
    payload: bytes | None


@dataclass
class RequestSnapshot:
    fingerprint: ModelFingerprint
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_computed_tokens: int  # tokens whose KV is in `blocks`
    sampling_params: SamplingParams
    generator_state: bytes | None  # the request's own generator (seeded requests)
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    num_cached_tokens: int = 0  # metrics so far: prompt tokens found cached at first admission
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    blocks: list[SnapshotBlock] = field(default_factory=list)
    frontend_state: dict | None = None  # the frontend's (detokenizer, metrics), JSON-ready
    version: int = FORMAT_VERSION

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    # ----- checks --------------------------------------------------------------------------

    def verify(self, fingerprint: ModelFingerprint) -> None:
        """Raise SnapshotError naming the first thing that makes this snapshot unusable by an
        engine with `fingerprint`. Blocks whose payload was left out are checked by the importer
        (they must be in its prefix cache)."""
        if self.version != FORMAT_VERSION:
            raise SnapshotError(f"snapshot format version {self.version} is not supported (this engine reads "
                                f"version {FORMAT_VERSION})")
        problem = fingerprint.mismatch(self.fingerprint)
        if problem is not None:
            raise SnapshotError(f"snapshot of request {self.request_id!r} is from another model: {problem}")
        if not self.prompt_token_ids:
            raise SnapshotError("snapshot has an empty prompt")
        if not all(type(t) is int for t in self.all_token_ids):
            raise SnapshotError("snapshot's token ids are not all integers")
        if not 0 <= self.num_computed_tokens < self.num_tokens:
            raise SnapshotError(f"snapshot claims {self.num_computed_tokens} computed tokens of {self.num_tokens}")
        block_size, block_bytes = fingerprint.layout.block_size, fingerprint.layout.block_bytes
        num_full, partial = divmod(self.num_computed_tokens, block_size)
        if len(self.blocks) != num_full + (partial > 0):
            raise SnapshotError(f"snapshot has {len(self.blocks)} KV blocks but its {self.num_computed_tokens} "
                                f"computed tokens need {num_full + (partial > 0)}")
        tokens = self.all_token_ids
        parent = root_hash(self.cache_salt)
        for index, block in enumerate(self.blocks):
            if index < num_full:
                parent = hash_block(parent, tokens[index * block_size:(index + 1) * block_size])
                if block.block_hash != parent:
                    raise SnapshotError(f"snapshot block {index}'s hash does not match its tokens")
            elif block.payload is None:
                raise SnapshotError("snapshot's partial last block has no payload")
            if block.payload is None:
                continue
            if len(block.payload) != block_bytes:
                raise SnapshotError(f"snapshot block {index} holds {len(block.payload)} bytes, expected {block_bytes}")
            if zlib.crc32(block.payload) != block.crc32:
                raise SnapshotError(f"snapshot block {index} is corrupt (crc32 mismatch)")

    # ----- the wire format -----------------------------------------------------------------

    def to_bytes(self) -> bytes:
        header = {name: getattr(self, name) for name in (
            "request_id", "prompt_token_ids", "output_token_ids", "num_computed_tokens", "eos_token_id",
            "arrival_time", "priority", "cache_salt", "num_cached_tokens", "num_preemptions",
            "first_scheduled_time", "frontend_state")}
        header["fingerprint"] = self.fingerprint.to_dict()
        header["sampling_params"] = _params_to_dict(self.sampling_params)
        header["generator_state"] = None if self.generator_state is None else base64.b64encode(
            self.generator_state).decode()
        header["blocks"] = [{"hash": None if b.block_hash is None else b.block_hash.hex(), "crc32": b.crc32,
                             "size": None if b.payload is None else len(b.payload)} for b in self.blocks]
        encoded = json.dumps(header, separators=(",", ":")).encode()
        payloads = [b.payload for b in self.blocks if b.payload is not None]
        return b"".join([MAGIC, _PREAMBLE.pack(self.version, len(encoded)), encoded, *payloads])

    @classmethod
    def from_bytes(cls, data: bytes) -> RequestSnapshot:
        """Parse a snapshot (SnapshotError if it is not one); `verify` checks its content."""
        view = memoryview(data)
        if bytes(view[:len(MAGIC)]) != MAGIC:
            raise SnapshotError("not a request snapshot (bad magic)")
        offset = len(MAGIC) + _PREAMBLE.size
        if len(view) < offset:
            raise SnapshotError("request snapshot is truncated")
        version, header_len = _PREAMBLE.unpack(view[len(MAGIC):offset])
        if version != FORMAT_VERSION:
            raise SnapshotError(f"snapshot format version {version} is not supported (this engine reads "
                                f"version {FORMAT_VERSION})")
        try:
            header = json.loads(bytes(view[offset:offset + header_len]))
            offset += header_len
            blocks = []
            for raw in header.pop("blocks"):
                payload = None
                if raw["size"] is not None:
                    payload = bytes(view[offset:offset + raw["size"]])
                    if len(payload) != raw["size"]:
                        raise SnapshotError("request snapshot is truncated (a block's payload is short)")
                    offset += raw["size"]
                blocks.append(SnapshotBlock(None if raw["hash"] is None else bytes.fromhex(raw["hash"]),
                                            int(raw["crc32"]), payload))
            if offset != len(view):
                raise SnapshotError(f"request snapshot has {len(view) - offset} bytes after its last block")
            check_frontend_state(header["frontend_state"])
            state = header.pop("generator_state")
            return cls(
                fingerprint=ModelFingerprint.from_dict(header.pop("fingerprint")),
                sampling_params=_params_from_dict(header.pop("sampling_params")),
                generator_state=None if state is None else base64.b64decode(state),
                blocks=blocks, version=version, **header,
            )
        except SnapshotError:
            raise
        except (ValueError, KeyError, TypeError) as error:  # malformed JSON or fields
            raise SnapshotError(f"request snapshot header is malformed: {error}") from None


FRONTEND_STATE_FIELDS = {"request_id": str, "prompt": (str, type(None)), "detokenizer": dict, "metrics": dict,
                         "logprobs": (list, type(None))}
DETOKENIZER_FIELDS = {"text": str, "prefix_offset": int, "read_offset": int, "num_emitted": int}


def check_frontend_state(state: object) -> None:
    """The frontend's part of a snapshot has the shape the frontend restores (SnapshotError if not)."""
    if state is None:
        return
    problem = None
    if not isinstance(state, dict) or set(state) != set(FRONTEND_STATE_FIELDS):
        problem = f"has fields {sorted(state) if isinstance(state, dict) else type(state).__name__}"
    elif not all(isinstance(state[k], t) for k, t in FRONTEND_STATE_FIELDS.items()):
        problem = "has a field of the wrong type"
    elif set(state["detokenizer"]) != set(DETOKENIZER_FIELDS) or not all(
            type(state["detokenizer"][k]) is t for k, t in DETOKENIZER_FIELDS.items()):
        problem = "has a malformed detokenizer state"
    if problem is not None:
        raise SnapshotError(f"snapshot's frontend state {problem}")


def _params_to_dict(params: SamplingParams) -> dict:
    raw = dataclasses.asdict(params)
    raw["output_kind"] = params.output_kind.value
    if params.logit_bias is not None:
        raw["logit_bias"] = [[token, bias] for token, bias in params.logit_bias.items()]
    return raw


def _params_from_dict(raw: dict) -> SamplingParams:
    raw = dict(raw)
    raw["output_kind"] = RequestOutputKind(raw["output_kind"])
    if raw.get("logit_bias") is not None:
        raw["logit_bias"] = {int(token): float(bias) for token, bias in raw["logit_bias"]}
    if raw.get("structured_outputs") is not None:
        raw["structured_outputs"] = StructuredOutputsParams(**raw["structured_outputs"])
    return SamplingParams(**raw)

"""What a block of KV bytes means, and which model wrote it.

A block's payload (`KVLayout.block_bytes` bytes) is its K then its V slots in every layer,
layer by layer: `[layer][K|V][block_size][kv_heads][head_dim]` in the pool's dtype. The same
payload travels in request snapshots, disk-tier files and (later) between instances, so KV
written by one engine is only ever read by an engine whose `ModelFingerprint` is equal: same
weights, same tokenizer (so the same token ids name the same text), same layout.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

DTYPE_SIZES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class KVLayout:
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    @property
    def slot_bytes(self) -> int:
        """One token's K (or V) in one layer."""
        return self.num_kv_heads * self.head_dim * DTYPE_SIZES[self.dtype]

    @property
    def block_bytes(self) -> int:
        return 2 * self.num_layers * self.block_size * self.slot_bytes


@dataclass(frozen=True)
class ModelFingerprint:
    """Identifies the KV a model writes: SHA-256 of its weights and of its tokenizer (hex),
    and the KV layout."""

    weights_hash: str
    tokenizer_hash: str
    layout: KVLayout

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> ModelFingerprint:
        return cls(raw["weights_hash"], raw["tokenizer_hash"], KVLayout(**raw["layout"]))

    def digest(self) -> bytes:
        """32 bytes naming this fingerprint (disk-tier files carry it)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).digest()

    def mismatch(self, other: ModelFingerprint) -> str | None:
        """What differs between `other` (the KV's writer) and this engine, or None."""
        for name in ("weights_hash", "tokenizer_hash"):
            if getattr(self, name) != getattr(other, name):
                return f"{name.replace('_', ' ')} differs (this engine's model is not the one that wrote the KV)"
        for name, mine in asdict(self.layout).items():
            theirs = getattr(other.layout, name)
            if mine != theirs:
                return f"KV layout differs: {name} is {theirs!r} in the KV but {mine!r} here"
        return None

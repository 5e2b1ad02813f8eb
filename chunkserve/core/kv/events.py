"""KV cache events: what the engine's caches gained and lost, for routers that place requests
where their prefix is cached (Dynamo's KV router and indexer, llm-d, SGLang's gateway, Ray's
KV-aware router). The events and their fields are vLLM's (`vllm/distributed/kv_events.py`),
since every such router reads vLLM's; the engine layer encodes and publishes them
(engine/kv_events.py). No torch, no sockets here: the KV cache manager, the pool and the disk
tier append to a `KVEventLog`, and the engine takes the log's events between steps.

- `BlockStored`: a run of consecutive full blocks of one request became cached, the parent of
  the first given (None for a sequence's first block), with their token ids. The disk tier
  reports each block it stores alone, with its own medium, no parent, no token ids and block
  size 0 (as vLLM's offloading tiers do).
- `BlockRemoved`: cached blocks were evicted (their KV is about to be overwritten) or their
  files deleted.
- `AllBlocksCleared`: the prefix cache was reset.

Hashes go out as vLLM publishes them by default: the low 64 bits of the block's SHA-256 chain
hash, unsigned (`external_block_hash`). The chain makes a block's hash name its whole prefix,
and is the same in every process, so N replicas name the same prefix alike.
"""

from __future__ import annotations

from dataclasses import dataclass

# vLLM's medium names. The pool is the tier the engine computes from, "GPU" to every consumer
# (as vLLM's CPU build reports its own pool); the disk tier's files are "STORAGE".
MEDIUM_POOL = "GPU"
MEDIUM_DISK = "STORAGE"

_LOW_64_BITS = (1 << 64) - 1


def external_block_hash(block_hash: bytes) -> int:
    """The hash a consumer sees: the low 64 bits of the SHA-256 digest, as an unsigned int
    (vLLM's `maybe_convert_block_hash` with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, its default)."""
    return int.from_bytes(block_hash, "big") & _LOW_64_BITS


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str
    # per block: the values its hash includes besides tokens (the cache salt on a sequence's
    # first block, (image hash, offset) pairs), None for a block with none; None when no block has any
    extra_keys: list[tuple | None] | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """The events since the engine last took them, in the order they happened. Removals of
    one medium in a row are merged into one event (an allocation evicting many blocks)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVCacheEvent] = []

    def stored(self, block_hashes: list[bytes], parent_hash: bytes | None, token_ids: list[int],
               extra_keys: list[tuple | None] | None = None) -> None:
        """Consecutive blocks of one sequence cached in the pool."""
        self._events.append(BlockStored(
            [external_block_hash(h) for h in block_hashes],
            None if parent_hash is None else external_block_hash(parent_hash),
            token_ids, self.block_size, MEDIUM_POOL, extra_keys))

    def stored_on(self, medium: str, block_hash: bytes) -> None:
        """A block stored in a tier that keeps no tokens (the disk tier's files)."""
        self._events.append(BlockStored([external_block_hash(block_hash)], None, [], 0, medium))

    def removed(self, block_hash: bytes, medium: str = MEDIUM_POOL) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(external_block_hash(block_hash))
        else:
            self._events.append(BlockRemoved([external_block_hash(block_hash)], medium))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        """The events so far, oldest first; the log is empty afterwards."""
        events, self._events = self._events, []
        return events

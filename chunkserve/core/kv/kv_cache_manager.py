"""Per-request block tables on top of the block pool, and the prefix cache.

Token position p of a request lives in KV slot
`block_table[p // block_size] * block_size + p % block_size`:

    block_size = 4, block_table = [7, 2]
    positions   0  1  2  3 | 4  5  6
    slots      28 29 30 31 | 8  9 10

Prefix caching (vLLM V1's scheme): a full block is named by a hash chain, SHA-256 over its
parent block's hash and its own token ids, so equal hashes mean equal whole prefixes and
a crafted prompt cannot collide with another user's prefix to read its KV. Whether a
prefix is cached does show (in `cached_tokens` and in TTFT), so a request may carry a
`cache_salt` (vLLM's field): it seeds the chain instead of the empty root, and requests
with different salts, or with a salt and without, never share a block. A block that holds
image placeholders also hashes which images and where in them (vLLM's extra keys: the image's
content hash and the block's start offset within its range), since every image of a size has
the same placeholder ids: the same image at the same place hits, another image never reuses its
KV. A text block's hash has no extra keys (the disk tier keys files by it). A new request
takes the longest run of cached blocks that starts its tokens and computes the rest; blocks
are registered in the cache as their last token's KV is computed (a chunked prompt's earlier
chunks become reusable while it is still prefilling).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Iterable, Sequence

from chunkserve.core.kv.block_pool import BlockPool
from chunkserve.core.kv.events import KVEventLog
from chunkserve.core.multimodal import MultiModalFeature
from chunkserve.core.request import Request
from chunkserve.errors import InvalidRequestError

ROOT_HASH = b""  # the parent of a request's first block


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def root_hash(cache_salt: str | None) -> bytes:
    """The parent of a request's first block: empty, or its salt's own hash."""
    if cache_salt is None:
        return ROOT_HASH
    return hashlib.sha256(b"cache_salt:" + cache_salt.encode("utf-8", "surrogatepass")).digest()


def hash_block(parent_hash: bytes, token_ids: Sequence[int], extra_keys: bytes = b"") -> bytes:
    """The hash of a full block: SHA-256 over its parent's hash, its token ids (int64) and its
    extra keys (`mm_extra_keys`; none for text)."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes() + extra_keys).digest()


def mm_extra_keys(features: Sequence[MultiModalFeature], start: int, end: int) -> bytes:
    """The extra keys of the block of positions [start, end): for each image whose range it
    overlaps, (content hash, the block's start offset within the range) (vLLM's
    `_gen_mm_extra_hash_keys`); empty for a text block."""
    return b"".join(f"mm:{f.identifier}:{max(start - f.offset, 0)};".encode()
                    for f in features if f.overlaps(start, end))


class KVCacheManager:
    """Owns every request's block table. The scheduler asks it for room before it
    schedules tokens; the model runner only ever sees copies of the tables."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 events: KVEventLog | None = None) -> None:
        """`events`: where what the prefix cache gains and loses is told (KV events), if anywhere."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.events = events
        self.pool = BlockPool(num_blocks, events)
        self._block_tables: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}  # leading blocks of each table already in the cache
        self._block_hashes: dict[str, list[bytes]] = {}  # of each request's full blocks, kept until it finishes

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return self._block_tables.get(request_id, [])

    # ----- the prefix cache ------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest run of cached blocks that starts the request's tokens, and how many
        tokens they hold. The last token is never covered, so at least one token is computed
        and there are logits to sample from. ([], 0) when caching is off or the request skips
        reading it."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        blocks = self.cached_run(self.block_hashes_for(request, (request.num_tokens - 1) // self.block_size))
        return blocks, len(blocks) * self.block_size

    def cached_run_for_import(self, block_hashes: list[bytes], has_payload: list[bool], num_tokens: int) -> list[int]:
        """The cached run that begins an imported request's `num_tokens` (its blocks named by
        `block_hashes`; `has_payload[i]`: block i's KV came with it). Raises if a block after the
        run came without its KV: nothing here could fill it."""
        cached = self.cached_run(block_hashes) if self.enable_caching else []
        missing = [i for i in range(len(cached), self.num_blocks_for(num_tokens)) if not has_payload[i]]
        if missing:
            raise InvalidRequestError(f"snapshot block {missing[0]}'s KV was left out but this engine's prefix cache "
                                      "does not hold it after the blocks before it: export the request again with "
                                      "its payload")
        return cached

    def cached_run(self, block_hashes: Iterable[bytes]) -> list[int]:
        """The cached blocks of the longest run of `block_hashes` from the first."""
        blocks = []
        for block_hash in block_hashes:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def next_block_in_flight(self, request: Request, num_cached_blocks: int, others: Iterable[Request]) -> bool:
        """Whether one of `others` is computing the request's next block (the one after its
        `num_cached_blocks` cached ones) as a prompt block of its own: the same tokens after
        the same prefix, not registered yet. Admitted now, the request would compute it a
        second time; a little later it reads it from the cache (n samples of one prompt, the
        same system prompt arriving twice)."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return False
        hashes = self.block_hashes_for(request, (request.num_tokens - 1) // self.block_size)
        if num_cached_blocks >= len(hashes):
            return False
        for other in others:
            if other.request_id == request.request_id:
                continue
            num_prompt_blocks = other.num_prompt_tokens // self.block_size
            if self._num_registered.get(other.request_id, 0) <= num_cached_blocks < num_prompt_blocks and \
                    self.block_hashes_for(other, num_prompt_blocks)[num_cached_blocks] == hashes[num_cached_blocks]:
                return True
        return False

    def cache_full_blocks(self, request: Request, num_verified_tokens: int) -> None:
        """Register the request's full blocks among its first `num_verified_tokens` tokens,
        whose KV is computed and final (never a draft token's, which may be rejected)."""
        if not self.enable_caching:
            return
        num_full = min(num_verified_tokens, request.num_tokens) // self.block_size
        first = self._num_registered.get(request.request_id, 0)
        if num_full <= first:
            return
        table = self._block_tables[request.request_id]
        hashes = self.block_hashes_for(request, num_full)
        newly_cached = [i for i in range(first, num_full) if self.pool.cache(table[i], hashes[i])]
        self._num_registered[request.request_id] = num_full
        if self.events is not None and newly_cached:
            self._tell_stored(request, hashes, newly_cached)

    def _tell_stored(self, request: Request, hashes: list[bytes], indices: list[int]) -> None:
        """One `BlockStored` per run of consecutive newly cached blocks (a block another request
        had cached first breaks a run: it is not this request's to announce)."""
        size, tokens = self.block_size, request.all_token_ids
        runs: list[list[int]] = []
        for i in indices:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            start, end = run[0], run[-1] + 1
            self.events.stored(hashes[start:end], hashes[start - 1] if start else None,
                               list(tokens[start * size : end * size]),
                               extra_keys=[self._event_extra_keys(request, i) for i in run])

    def _event_extra_keys(self, request: Request, index: int) -> tuple | None:
        """What block `index`'s hash includes besides its tokens, as vLLM's events carry it:
        (image hash, offset) pairs, then the cache salt on a sequence's first block."""
        start, end = index * self.block_size, (index + 1) * self.block_size
        keys: list = [(f.identifier, max(start - f.offset, 0)) for f in request.mm_features if f.overlaps(start, end)]
        if index == 0 and request.cache_salt is not None:
            keys.append(request.cache_salt)
        return tuple(keys) or None

    def block_hashes(self, request_id: str) -> list[bytes]:
        """The hash chain of the request's full blocks computed so far."""
        return list(self._block_hashes.get(request_id, []))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; refused (False) while any request holds blocks."""
        return self.pool.reset_cache()

    def block_hashes_for(self, request: Request, num_blocks: int) -> list[bytes]:
        """The hashes of the request's first `num_blocks` full blocks, extending the ones
        already computed (its tokens never change, only grow)."""
        hashes = self._block_hashes.setdefault(request.request_id, [])
        if len(hashes) < num_blocks:
            size = self.block_size
            end = num_blocks * size
            tokens = request.prompt_token_ids if end <= request.num_prompt_tokens else request.all_token_ids
            parent = hashes[-1] if hashes else root_hash(request.cache_salt)
            features = request.mm_features
            for i in range(len(hashes), num_blocks):
                extra = mm_extra_keys(features, i * size, (i + 1) * size) if features else b""
                parent = hash_block(parent, tokens[i * size : (i + 1) * size], extra)
                hashes.append(parent)
        return hashes[:num_blocks]

    # ----- block tables ----------------------------------------------------------------

    def num_available_blocks(self, computed_blocks: Sequence[int] = ()) -> int:
        """Blocks a request not yet admitted could hold in all: the cached blocks it would
        take plus every free block that is not one of those."""
        free_among_computed = sum(1 for b in computed_blocks if self.pool.ref_count(b) == 0)
        return len(computed_blocks) + self.pool.num_free_blocks - free_among_computed

    def allocate_slots(self, request_id: str, num_total_tokens: int,
                       computed_blocks: Sequence[int] = ()) -> list[int] | None:
        """Make room for the request's first `num_total_tokens` tokens. A request's first
        allocation starts its table with `computed_blocks` (its prefix-cache hit).

        Returns the newly allocated block ids (possibly none), or None when the pool is
        short; then nothing is taken and the caller decides whom to preempt.
        """
        table = self._block_tables.get(request_id)
        if table is None:
            needed = self.num_blocks_for(num_total_tokens) - len(computed_blocks)
            if needed > self.num_available_blocks(computed_blocks) - len(computed_blocks):
                return None
            self.pool.touch(list(computed_blocks))  # first, so the allocation cannot evict them
            new_blocks = self.pool.allocate(needed)
            assert new_blocks is not None
            self._block_tables[request_id] = [*computed_blocks, *new_blocks]
            self._num_registered[request_id] = len(computed_blocks)
            return new_blocks
        needed = self.num_blocks_for(num_total_tokens) - len(table)
        if needed <= 0:
            return []
        new_blocks = self.pool.allocate(needed)
        if new_blocks is None:
            return None
        table.extend(new_blocks)
        return new_blocks

    def free(self, request_id: str) -> None:
        """Drop the request's hold on its blocks; a no-op if it holds none. The last block
        is released first, so under pressure a prefix's tail is evicted before its head."""
        table = self._block_tables.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        if table:
            self.pool.free(table[::-1])

    def remove_request(self, request_id: str) -> None:
        """The request finished: free its blocks and forget its hashes."""
        self.free(request_id)
        self._block_hashes.pop(request_id, None)

    def detach(self, request_id: str) -> list[int]:
        """The request finished but its blocks stay held (their KV is still being sent): they
        are no longer its, so its id may be reused at once. Free them with `free_blocks`."""
        table = self._block_tables.pop(request_id, [])
        self._num_registered.pop(request_id, None)
        self._block_hashes.pop(request_id, None)
        return table

    def check(self, detached: list[list[int]]) -> list[str]:
        """The pool's consistency with every block table and the `detached` tables still held."""
        holders = Counter(b for table in [*self._block_tables.values(), *detached] for b in table)
        return self.pool.check(holders)

    def registry_sizes(self) -> dict[str, int]:
        """Entries of each per-request table (every one empty once no request is left)."""
        return {"block_tables": len(self._block_tables), "num_registered": len(self._num_registered),
                "block_hashes": len(self._block_hashes)}

    def free_blocks(self, block_ids: list[int]) -> None:
        """Release blocks taken with `detach`, the last first (as `free`)."""
        self.pool.free(block_ids[::-1])

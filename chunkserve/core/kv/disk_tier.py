"""The disk KV tier's scheduler side (SGLang's HiCache flags, vLLM's OffloadingManager verbs):
KV blocks persisted as files (disk_store.py), found by their prefix-cache hash, loaded back
into the pool instead of being recomputed, across requests and across restarts. No torch: what
moves bytes is the worker side (worker/disk_tier.py), reached only through the step's
metadata and its output, so the two sides could live in different processes.

- The index: the blocks stored (hash -> file size), least recently stored or loaded first,
  rebuilt at start from this model's folder (sizes from stat; headers are checked on load).
- Lookup (`get_num_new_matched_tokens`): the run of the request's block hashes right after
  the pool's hit that the index holds (never the last token's block). The load is
  asynchronous: the request waits as WAITING_FOR_REMOTE_KVS holding its blocks, the worker
  reads the files on its I/O thread and copies them into the pool between steps, and reports
  the request loaded; a block that failed (missing, corrupt) is reported invalid and the
  request computes from there.
- Saves: `write_through` saves a block once its KV is computed (registered in the prefix
  cache); `write_back` when the pool evicts it. Either way the worker copies it out of the
  pool at the start of the next step, before that step's forward can overwrite it. A write
  enters the index only once the worker confirms it, so a block being written is never
  loadable. Hashes stored or pending are not saved again.
- The size limit (`hicache_storage_max_gb`, this model's folder): room for a save is made when
  it is handed to the worker, by deleting the least recently used files (a file being loaded
  may go: its load fails, its tokens are recomputed).
- A request finished while its load is in flight: the load is cancelled in the next step's
  metadata (the worker copies loads only between steps, on the engine thread, so the blocks
  may be freed at once).
- Shutdown: `write_back` saves every cached block of the pool the tier lacks; the engine
  steps until every pending write has landed (`has_pending_work`).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from chunkserve.config.kv_connector import KVConnectorConfig
from chunkserve.config.kv_tier import HICACHE_WRITE_POLICIES, KVTierConfig
from chunkserve.core.kv.disk_store import BlockFiles, default_storage_dir, max_bytes_of
from chunkserve.core.kv.events import MEDIUM_DISK
from chunkserve.core.kv.layout import ModelFingerprint
from chunkserve.core.kv_connector import KVConnectorScheduler
from chunkserve.core.request import Request
from chunkserve.core.stats import KVTierStats
from chunkserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)


@dataclass
class DiskTierMetadata:
    """One step's work for the worker side, in the order it does it: drop `cancelled`
    requests' loads, copy `saves` out of the pool (before the forward), start `loads`."""

    loads: dict[str, list[tuple[int, bytes]]] = field(default_factory=dict)  # request id -> (block id, hash)
    saves: list[tuple[int, bytes]] = field(default_factory=list)  # (block id, hash)
    cancelled: set[str] = field(default_factory=set)
    idle: bool = False  # the step computes nothing: the worker may wait a few ms for its I/O


@dataclass
class LoadReport:
    """A request's load, finished: how many of its blocks, how many leading ones are valid."""

    request_id: str
    num_blocks: int
    num_valid: int
    bytes: int
    seconds: float


@dataclass
class DiskTierOutput:
    """The worker side's report since its last one: blocks it could not load (`corrupt`: the
    file was there but wrong, and is removed; else missing), writes confirmed and failed,
    finished loads. Bad blocks come first: a hash reported bad, then stored again, is stored."""

    bad_blocks: list[tuple[bytes, bool]] = field(default_factory=list)  # (hash, corrupt)
    stored: list[tuple[bytes, int, float]] = field(default_factory=list)  # (hash, bytes, seconds)
    failed_stores: list[bytes] = field(default_factory=list)
    loads: list[LoadReport] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.bad_blocks or self.stored or self.failed_stores or self.loads)


class DiskTierScheduler(KVConnectorScheduler):
    def __init__(self, files: BlockFiles, max_bytes: int, write_policy: str = "write_through") -> None:
        if write_policy not in HICACHE_WRITE_POLICIES:
            raise InvalidRequestError(f"hicache_write_policy must be one of {HICACHE_WRITE_POLICIES}, "
                                      f"got {write_policy!r}")
        self.files = files
        self.max_bytes = max_bytes
        self.write_policy = write_policy
        self.block_size = files.layout.block_size
        self.kv = None
        self._index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file bytes, least recently used first
        self._stored_bytes = 0
        self._to_save: dict[bytes, int] = {}  # hash -> block id: saves not yet handed to the worker
        self._saving: dict[bytes, int] = {}  # hash -> bytes reserved: handed over, not yet confirmed
        self._reserved_bytes = 0
        self._doomed: set[bytes] = set()  # writes in flight when the tier was reset: deleted when they land
        self._matched: dict[str, tuple[int, list[bytes]]] = {}  # request id -> (first block, hashes) found
        self._loads: dict[str, list[tuple[int, bytes]]] = {}  # planned, not yet sent
        self._loading: set[str] = set()  # planned or sent, not yet reported loaded
        self._cancelled: set[str] = set()
        self._hit_tokens = self._load_bytes = self._store_bytes = self._corrupt = 0
        self._load_seconds = self._store_seconds = 0.0
        for block_hash, size, _ in files.scan():  # oldest first: the LRU order of the last run
            self._index[block_hash] = size
            self._stored_bytes += size
        found_files, found_bytes = len(self._index), self._stored_bytes
        self._evict_until(0)
        logger.info("disk KV tier: %s, %d block files (%.1f MiB) found, %s, limit %.2f GiB%s", files.folder,
                    found_files, found_bytes / (1 << 20), write_policy, max_bytes / (1 << 30),
                    f"; {found_files - len(self._index)} removed to fit" if len(self._index) < found_files else "")

    @classmethod
    def from_config(cls, config: KVConnectorConfig, fingerprint: Callable[[], ModelFingerprint]) -> DiskTierScheduler:
        tier = config.kv_tier
        return cls(block_files_of(tier, fingerprint()), max_bytes_of(tier.hicache_storage_max_gb),
                   tier.hicache_write_policy)

    # ----- the scheduler's verbs ------------------------------------------------------------

    def bind_kv_cache(self, kv) -> None:
        """Also announces the files found at start, when KV events are on."""
        self.kv = kv
        if kv.events is not None:
            for block_hash in self._index:
                kv.events.stored_on(MEDIUM_DISK, block_hash)
        if self.write_policy == "write_back":
            kv.pool.on_evict = self._save_later
        else:
            kv.pool.on_cache = self._save_later

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        first = num_computed_tokens // self.block_size
        last = (request.num_tokens - 1) // self.block_size  # the last token is always computed
        if first >= last or not self._index or request.skip_reading_prefix_cache:
            return 0, False
        found = []
        for block_hash in self.kv.block_hashes_for(request, last)[first:]:
            if block_hash not in self._index:
                break
            found.append(block_hash)
        if not found:
            return 0, False
        self._matched[request.request_id] = (first, found)
        return len(found) * self.block_size, True

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        _, found = self._matched.pop(request.request_id, (0, []))
        count = min(num_external_tokens // self.block_size, len(found))
        if count == 0:
            return
        hashes = found[:count]
        blocks = list(zip(block_ids[len(block_ids) - count:], hashes))
        for block_hash in reversed(hashes):  # recently used, the head of the prefix most: evicted last
            self._index.move_to_end(block_hash)
            self.files.touch(block_hash)
        self._loads[request.request_id] = blocks
        self._loading.add(request.request_id)

    def build_connector_meta(self, scheduler_output) -> DiskTierMetadata:
        saves = []
        for block_hash, block_id in self._to_save.items():
            if block_hash not in self._index and block_hash not in self._saving and self._reserve(block_hash):
                saves.append((block_id, block_hash))
        self._to_save.clear()
        meta = DiskTierMetadata(self._loads, saves, self._cancelled, scheduler_output.is_empty)
        self._loads, self._cancelled = {}, set()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        request_id = request.request_id
        self._matched.pop(request_id, None)
        if request_id in self._loading:  # its load is in flight: the worker drops it before copying any more
            self._loading.discard(request_id)
            if self._loads.pop(request_id, None) is None:
                self._cancelled.add(request_id)
        return False, None

    def update_connector_output(self, output: DiskTierOutput | None) -> None:
        if not output:
            return
        for block_hash, corrupt in output.bad_blocks:
            self._corrupt += corrupt
            size = self._index.pop(block_hash, None)
            if size is not None:
                self._stored_bytes -= size
                self._tell_removed(block_hash)
        for block_hash, num_bytes, seconds in reversed(output.stored):  # a prefix's head is evicted after its tail
            self._unreserve(block_hash)
            if block_hash in self._doomed:  # written after the tier was reset
                self._doomed.discard(block_hash)
                self.files.remove(block_hash)
                continue
            replaced = self._index.pop(block_hash, None)
            self._stored_bytes += num_bytes - (replaced or 0)
            self._index[block_hash] = num_bytes
            if replaced is None and self.kv is not None and self.kv.events is not None:
                self.kv.events.stored_on(MEDIUM_DISK, block_hash)
            self._store_bytes += num_bytes
            self._store_seconds += seconds
        for block_hash in output.failed_stores:
            self._unreserve(block_hash)
            self._doomed.discard(block_hash)
        for report in output.loads:
            self._loading.discard(report.request_id)
            self._hit_tokens += report.num_valid * self.block_size
            self._load_bytes += report.bytes
            self._load_seconds += report.seconds

    def has_pending_work(self) -> bool:
        return bool(self._to_save or self._saving or self._cancelled)

    def begin_shutdown(self) -> None:
        """With write_back, save every cached block of the pool the tier lacks (they would be
        lost with the process); with write_through they are saved already or pending."""
        if self.write_policy == "write_back" and self.kv is not None:
            for block_hash, block_id in self.kv.pool.cached_blocks():
                self._save_later(block_id, block_hash)

    def reset_cache(self) -> None:
        """Forget every stored block and remove this model's files (writes in flight are
        removed when they land)."""
        self._to_save.clear()
        self._doomed.update(self._saving)
        for block_hash in self._index:
            self._tell_removed(block_hash)
        self._index.clear()
        self._stored_bytes = 0
        self.files.remove_all()

    def registry_sizes(self) -> dict[str, int]:
        return {"matched": len(self._matched), "loads": len(self._loads), "loading": len(self._loading)}

    def get_kv_connector_stats(self) -> KVTierStats:
        return KVTierStats(
            hit_tokens_total=self._hit_tokens, load_bytes_total=self._load_bytes,
            load_seconds_total=self._load_seconds, store_bytes_total=self._store_bytes,
            store_seconds_total=self._store_seconds, corrupt_blocks_total=self._corrupt,
            stored_files=len(self._index), stored_bytes=self._stored_bytes,
        )

    # ----- what is stored --------------------------------------------------------------------

    def is_stored(self, block_hash: bytes) -> bool:
        return block_hash in self._index

    def stored_hashes(self) -> list[bytes]:
        """Least recently used first."""
        return list(self._index)

    def stored_block_hashes(self) -> dict[str, list[bytes]]:
        return {MEDIUM_DISK: self.stored_hashes()}

    def _save_later(self, block_id: int, block_hash: bytes) -> None:
        if block_hash not in self._index and block_hash not in self._saving:
            self._to_save.setdefault(block_hash, block_id)

    def _reserve(self, block_hash: bytes) -> bool:
        """Room for one more file, made by evicting the least recently used ones; False if
        the writes already in flight leave none."""
        size = self.files.file_bytes
        if self._reserved_bytes + size > self.max_bytes:
            return False
        self._evict_until(size)
        self._saving[block_hash] = size
        self._reserved_bytes += size
        return True

    def _unreserve(self, block_hash: bytes) -> None:
        self._reserved_bytes -= self._saving.pop(block_hash, 0)

    def _evict_until(self, room: int) -> None:
        """Delete least recently used files until `room` more bytes fit under the limit."""
        while self._index and self._stored_bytes + self._reserved_bytes + room > self.max_bytes:
            block_hash, size = self._index.popitem(last=False)
            self._stored_bytes -= size
            self.files.remove(block_hash)
            self._tell_removed(block_hash)

    def _tell_removed(self, block_hash: bytes) -> None:
        if self.kv is not None and self.kv.events is not None:
            self.kv.events.removed(block_hash, MEDIUM_DISK)


def block_files_of(config: KVTierConfig, fingerprint: ModelFingerprint) -> BlockFiles:
    """The engine's block files (the folder is created here, so a bad directory fails at start)."""
    root = os.path.abspath(os.path.expanduser(config.hicache_storage_dir or default_storage_dir()))
    files = BlockFiles(root, fingerprint)
    try:
        os.makedirs(files.folder, exist_ok=True)
    except OSError as error:
        raise InvalidRequestError(f"hicache_storage_dir {root!r} is not usable: {error}") from None
    if not os.access(files.folder, os.W_OK | os.X_OK):
        raise InvalidRequestError(f"hicache_storage_dir {root!r} is not writable")
    return files

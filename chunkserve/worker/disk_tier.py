"""The disk KV tier's worker side (its scheduler side: core/kv/disk_tier.py): block payloads
between the pool tensor and the block files (core/kv/disk_store.py).

One I/O thread reads and writes the files (file I/O and zlib.crc32 release the GIL, so it
runs beside the forward); reads go before writes, as requests wait for them. Only the
engine thread touches the pool, in `start_load_kv` at the start of every step (empty ones too):

  1. drop the loads of cancelled requests (their blocks may already be someone else's),
  2. copy the blocks to save out of the pool and queue their writes (this step's forward may
     overwrite them: an evicted block's new owner, for one),
  3. queue the reads of new loads,
  4. copy finished reads into the pool; a request whose blocks are all in is reported in
     `finished_recving`, with the blocks that failed (missing, corrupt) in
     `get_block_ids_with_load_errors` so that it recomputes from the first of them.

Confirmed writes, bad blocks and load timings go back in `take_connector_output`. When the
step computes nothing and I/O is in flight, it waits a few ms for it instead of spinning."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from chunkserve.config.kv_connector import KVConnectorConfig
from chunkserve.core.kv.disk_store import BlockFiles, ReadResult
from chunkserve.core.kv.disk_tier import DiskTierMetadata, DiskTierOutput, LoadReport, block_files_of
from chunkserve.core.kv.layout import ModelFingerprint
from chunkserve.core.kv_connector import KVConnectorWorker
from chunkserve.worker.kv_cache import read_blocks, write_blocks

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.005  # an empty step with I/O in flight waits this long for a completion
_READ, _WRITE, _STOP = 0, 1, 2  # also the I/O thread's priorities: reads first


@dataclass
class _Load:
    serial: int  # tells this load's reads from an earlier, cancelled one's under the same request id
    blocks: list[tuple[int, bytes]]  # (block id, hash), in table order
    results: dict[int, ReadResult] = field(default_factory=dict)  # by index into blocks


class DiskTierWorker(KVConnectorWorker):
    def __init__(self, files: BlockFiles, idle_wait_s: float = IDLE_WAIT_S) -> None:
        self.files = files
        self.block_size = files.layout.block_size
        self.idle_wait_s = idle_wait_s
        self.kv_pool: torch.Tensor | None = None
        self._meta: DiskTierMetadata | None = None
        self._loads: dict[str, _Load] = {}
        self._serials = itertools.count()
        self._order = itertools.count()
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._in_flight = 0
        self._finished_recving: set[str] = set()
        self._invalid_block_ids: set[int] = set()
        self._output = DiskTierOutput()
        self._thread = threading.Thread(target=self._run_io, name="chunkserve-hicache-io", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: KVConnectorConfig, fingerprint: Callable[[], ModelFingerprint]) -> DiskTierWorker:
        return cls(block_files_of(config.kv_tier, fingerprint()))

    # ----- the worker's verbs ---------------------------------------------------------------

    def register_kv_caches(self, kv_pool: torch.Tensor) -> None:
        self.kv_pool = kv_pool

    def bind_connector_metadata(self, metadata: DiskTierMetadata | None) -> None:
        self._meta = metadata

    def start_load_kv(self) -> None:
        meta, self._meta = self._meta, None
        if meta is None:  # a step built without the scheduler (the start-up profile): only progress
            meta = DiskTierMetadata()
        for request_id in meta.cancelled:
            self._loads.pop(request_id, None)
        if meta.saves:
            payloads = read_blocks(self.kv_pool, [block_id for block_id, _ in meta.saves], self.block_size)
            for (_, block_hash), payload in zip(meta.saves, payloads):
                self._submit(_WRITE, (block_hash, payload))
        for request_id, blocks in meta.loads.items():
            load = _Load(next(self._serials), list(blocks))
            self._loads[request_id] = load
            for index, (_, block_hash) in enumerate(blocks):
                self._submit(_READ, (request_id, load.serial, index, block_hash))
        self._progress(wait=meta.idle)

    def get_finished(self, finished_request_ids: set[str]) -> tuple[set[str], set[str]]:
        done, self._finished_recving = self._finished_recving, set()
        return set(), done

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid

    def take_connector_output(self) -> DiskTierOutput | None:
        if not self._output:
            return None
        output, self._output = self._output, DiskTierOutput()
        return output

    def shutdown(self) -> None:
        """Stop the I/O thread once the writes queued so far are done."""
        if self._thread.is_alive():
            self._submit(_STOP, None)
            self._thread.join(timeout=30)

    # ----- the engine thread's side -------------------------------------------------------------

    def _submit(self, kind: int, job) -> None:
        self._jobs.put((kind, next(self._order), job))
        self._in_flight += kind != _STOP

    def _progress(self, wait: bool) -> None:
        """Take what the I/O thread finished (waiting a little for something if `wait` and
        anything is in flight) and copy finished reads into the pool."""
        completions = []
        if wait and self._in_flight:
            try:
                completions.append(self._done.get(timeout=self.idle_wait_s))
            except queue.Empty:
                pass
        while True:
            try:
                completions.append(self._done.get_nowait())
            except queue.Empty:
                break
        if not completions:
            return
        self._in_flight -= len(completions)
        block_ids, payloads, touched = [], [], set()
        output = self._output
        for kind, job, result in completions:
            if kind == _WRITE:
                block_hash, seconds, error = job[0], result[0], result[1]
                if error is None:
                    output.stored.append((block_hash, self.files.file_bytes, seconds))
                else:
                    logger.warning("disk KV tier: writing block %s failed: %s", block_hash.hex()[:16], error)
                    output.failed_stores.append(block_hash)
                continue
            request_id, serial, index, block_hash = job
            if not result.ok:
                output.bad_blocks.append((block_hash, result.corrupt))
                if result.corrupt:
                    logger.warning("disk KV tier: block file %s is corrupt (%s); removed, its tokens are recomputed",
                                   block_hash.hex()[:16], result.problem)
            load = self._loads.get(request_id)
            if load is None or load.serial != serial:  # cancelled
                continue
            load.results[index] = result
            touched.add(request_id)
            if result.ok:
                block_ids.append(load.blocks[index][0])
                payloads.append(result.payload)
        if block_ids:
            write_blocks(self.kv_pool, block_ids, self.block_size, payloads)
        for request_id in touched:
            load = self._loads[request_id]
            if len(load.results) < len(load.blocks):
                continue
            del self._loads[request_id]
            results = [load.results[i] for i in range(len(load.blocks))]
            num_valid = next((i for i, r in enumerate(results) if not r.ok), len(results))
            self._invalid_block_ids.update(block_id for (block_id, _), r in zip(load.blocks, results) if not r.ok)
            self._finished_recving.add(request_id)
            output.loads.append(LoadReport(request_id, len(results), num_valid, num_valid * self.files.file_bytes,
                                           sum(r.seconds for r in results)))

    # ----- the I/O thread --------------------------------------------------------------------------

    def _run_io(self) -> None:
        files = self.files
        while True:
            kind, _, job = self._jobs.get()
            if kind == _STOP:
                return
            if kind == _WRITE:
                block_hash, payload = job
                try:
                    result = (files.write(block_hash, payload), None)
                except Exception as error:  # a full or broken disk: the block is simply not stored
                    result = (0.0, repr(error))
                self._done.put((kind, (block_hash,), result))
            else:
                try:
                    result = files.read(job[3])
                except Exception as error:
                    result = ReadResult(None, repr(error))
                self._done.put((kind, job, result))

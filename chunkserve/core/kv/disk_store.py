"""The disk tier's files: one file per KV block, named by its block hash, under a folder named
by the model's fingerprint (no torch; both sides of the tier use it: the scheduler's side
scans, indexes and deletes, the worker's side reads and writes).

    <dir>/<fingerprint.digest().hex()[:16]>/<block_hash.hex()[:2]>/<block_hash.hex()>.kv

A file is a fixed header, then the block's payload (`KVLayout.block_bytes` bytes, what
`read_blocks` gives):

    magic (8 bytes) | format version (u16) | dtype code (u16) | fingerprint digest (32 bytes)
    | block hash (32 bytes) | block_size, num_layers, num_kv_heads, head_dim (u32 each)
    | payload length (u64) | crc32 of the payload (u32)          (little-endian, 104 bytes)

A block is written to a temporary name in its folder and renamed into place (`os.replace`),
so a half-written block is never read under its real name. Reading checks everything: any
mismatch (magic, version, fingerprint, hash, layout, length, short or long file, crc) is a
miss, never KV.
"""

from __future__ import annotations

import itertools
import os
import struct
import time
import zlib
from dataclasses import dataclass

from chunkserve.core.kv.layout import KVLayout, ModelFingerprint

MAGIC = b"CSKVBLK\x00"
FORMAT_VERSION = 1
DTYPE_CODES = {"float32": 1, "bfloat16": 2}
HEADER = struct.Struct("<8sHH32s32sIIIIQI")
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
_GIB = 1 << 30


def default_storage_dir() -> str:
    """`$CHUNKSERVE_CACHE/hicache`, or `~/.cache/chunkserve/hicache`."""
    root = os.environ.get("CHUNKSERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "chunkserve"))
    return os.path.join(root, "hicache")


def max_bytes_of(max_gb: float) -> int:
    return int(max_gb * _GIB)


@dataclass(frozen=True)
class ReadResult:
    """A block file read: its payload, or why it is a miss (`corrupt`: the file was there but
    is not this block's KV, and has been removed; otherwise it was missing or unreadable)."""

    payload: bytes | memoryview | None
    problem: str | None = None
    corrupt: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.payload is not None


class BlockFiles:
    """The block files of one model (fingerprint) under `root`."""

    def __init__(self, root: str, fingerprint: ModelFingerprint) -> None:
        self.root = root
        self.fingerprint = fingerprint
        self.layout: KVLayout = fingerprint.layout
        self.digest = fingerprint.digest()
        self.folder = os.path.join(root, self.digest.hex()[:16])
        self.payload_bytes = self.layout.block_bytes
        self.file_bytes = HEADER.size + self.payload_bytes
        self._serial = itertools.count()

    def path(self, block_hash: bytes) -> str:
        name = block_hash.hex()
        return os.path.join(self.folder, name[:2], name + SUFFIX)

    def header(self, block_hash: bytes, payload_crc: int, digest: bytes | None = None,
               layout: KVLayout | None = None, payload_length: int | None = None) -> bytes:
        """The header of `block_hash`'s file (the other arguments let tests forge bad ones)."""
        layout = layout or self.layout
        return HEADER.pack(MAGIC, FORMAT_VERSION, DTYPE_CODES[layout.dtype], digest or self.digest, block_hash,
                           layout.block_size, layout.num_layers, layout.num_kv_heads, layout.head_dim,
                           self.payload_bytes if payload_length is None else payload_length, payload_crc)

    # ----- the worker's side: whole blocks in and out -----------------------------------------

    def write(self, block_hash: bytes, payload: bytes) -> float:
        """Store one block (temporary name, then renamed into place); returns its seconds.
        Raises OSError (the temporary file is removed) or ValueError (wrong payload size)."""
        if len(payload) != self.payload_bytes:
            raise ValueError(f"a block payload is {self.payload_bytes} bytes, got {len(payload)}")
        start = time.perf_counter()
        path = self.path(block_hash)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{next(self._serial)}{TMP_SUFFIX}"
        try:
            with open(tmp, "wb") as f:
                f.write(self.header(block_hash, zlib.crc32(payload)))
                f.write(payload)
            os.replace(tmp, path)
        except BaseException:
            _remove(tmp)
            raise
        return time.perf_counter() - start

    def read(self, block_hash: bytes) -> ReadResult:
        """One block's payload, checked; a file that is not this block's KV is removed."""
        start = time.perf_counter()
        path = self.path(block_hash)
        try:
            with open(path, "rb", buffering=0) as f:
                data = _read_up_to(f, self.file_bytes + 1)  # one more: a longer file is wrong too
        except FileNotFoundError:
            return ReadResult(None, "missing")
        except OSError as error:
            return ReadResult(None, f"unreadable: {error}")
        problem = self.check(block_hash, data)
        if problem is not None:
            _remove(path)
            return ReadResult(None, problem, corrupt=True, seconds=time.perf_counter() - start)
        return ReadResult(memoryview(data)[HEADER.size:], seconds=time.perf_counter() - start)

    def check(self, block_hash: bytes, data: bytes | bytearray) -> str | None:
        """What is wrong with `data` as `block_hash`'s file, or None."""
        if len(data) < HEADER.size:
            return f"short file ({len(data)} bytes)"
        (magic, version, dtype_code, digest, stored_hash, block_size, num_layers, num_kv_heads, head_dim,
         length, crc) = HEADER.unpack_from(data)
        layout = self.layout
        if magic != MAGIC:
            return "bad magic"
        if version != FORMAT_VERSION:
            return f"format version {version}, not {FORMAT_VERSION}"
        if digest != self.digest:
            return "written by another model (fingerprint differs)"
        if stored_hash != block_hash:
            return "holds another block"
        if (dtype_code, block_size, num_layers, num_kv_heads, head_dim) != (
                DTYPE_CODES[layout.dtype], layout.block_size, layout.num_layers, layout.num_kv_heads,
                layout.head_dim):
            return "KV layout differs"
        if length != self.payload_bytes:
            return f"payload length {length}, not {self.payload_bytes}"
        if len(data) != self.file_bytes:
            return f"file is {len(data)} bytes, not {self.file_bytes}"
        if zlib.crc32(memoryview(data)[HEADER.size:]) != crc:
            return "crc32 mismatch"
        return None

    # ----- the scheduler's side: what is there, and deleting ------------------------------------

    def scan(self) -> list[tuple[bytes, int, float]]:
        """(block hash, file size, mtime) of every block file of this model, oldest first;
        leftover temporary files (a writer that died) are removed."""
        found = []
        try:
            subfolders = os.scandir(self.folder)
        except FileNotFoundError:
            return []
        with subfolders:
            for sub in subfolders:
                if not sub.is_dir(follow_symlinks=False):
                    continue
                with os.scandir(sub.path) as entries:
                    for entry in entries:
                        name = entry.name
                        if name.endswith(TMP_SUFFIX):
                            _remove(entry.path)
                            continue
                        if not name.endswith(SUFFIX):
                            continue
                        block_hash = _parse_hash(name[: -len(SUFFIX)])
                        if block_hash is None:
                            continue
                        try:
                            stat = entry.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        found.append((block_hash, stat.st_size, stat.st_mtime))
        found.sort(key=lambda item: item[2])
        return found

    def remove(self, block_hash: bytes) -> None:
        _remove(self.path(block_hash))

    def touch(self, block_hash: bytes) -> None:
        """Mark a file recently used (its mtime orders the LRU index a restart rebuilds)."""
        try:
            os.utime(self.path(block_hash))
        except OSError:
            pass

    def remove_all(self) -> int:
        """Remove every file of this model (block files and temporary ones); returns how many."""
        removed = 0
        for block_hash, _, _ in self.scan():  # (scan removes the temporary files)
            self.remove(block_hash)
            removed += 1
        return removed


def _read_up_to(f, size: int) -> bytearray:
    data = bytearray(size)
    view = memoryview(data)
    filled = 0
    while filled < size:
        count = f.readinto(view[filled:])
        if not count:
            break
        filled += count
    del view
    del data[filled:]
    return data


def _parse_hash(text: str) -> bytes | None:
    if len(text) != 64:
        return None
    try:
        return bytes.fromhex(text)
    except ValueError:
        return None


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
    except OSError:
        pass

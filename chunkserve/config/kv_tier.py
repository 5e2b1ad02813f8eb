"""The disk KV tier's configuration (SGLang's HiCache flags): blocks kept on disk too, found
again by their prefix-cache hash, across restarts."""

from __future__ import annotations

from dataclasses import dataclass

from chunkserve.config.fields import arg
from chunkserve.errors import InvalidRequestError

HICACHE_STORAGE_BACKENDS = ("file",)
HICACHE_WRITE_POLICIES = ("write_through", "write_back")


@dataclass(frozen=True)
class KVTierConfig:
    enable_hierarchical_cache: bool = arg(
        False, "keep KV blocks on disk too (SGLang's HiCache flags): a prompt whose blocks the pool no longer "
        "holds loads them from there instead of recomputing them, across restarts too (needs prefix caching)"
    )
    hicache_storage_backend: str = arg("file", "where the disk tier keeps blocks: file = one file per block "
                                       "under --hicache-storage-dir", choices=HICACHE_STORAGE_BACKENDS)
    hicache_storage_dir: str | None = arg(
        None, "the disk tier's folder; each model's blocks go in a subfolder named by its fingerprint "
        "(default: $CHUNKSERVE_CACHE/hicache, or ~/.cache/chunkserve/hicache)"
    )
    hicache_storage_max_gb: float = arg(
        10.0, "most GiB of block files one model keeps in the disk tier; the least recently stored or loaded "
        "are deleted first"
    )
    hicache_write_policy: str = arg(
        "write_through", "when a block goes to disk: write_through = once its KV is computed; write_back = "
        "when the pool evicts it (and, at shutdown, every block the pool caches)", choices=HICACHE_WRITE_POLICIES
    )

    def __post_init__(self) -> None:
        if self.hicache_storage_backend not in HICACHE_STORAGE_BACKENDS:
            raise InvalidRequestError(f"hicache_storage_backend must be one of {HICACHE_STORAGE_BACKENDS}, "
                                      f"got {self.hicache_storage_backend!r}")
        if self.hicache_write_policy not in HICACHE_WRITE_POLICIES:
            raise InvalidRequestError(f"hicache_write_policy must be one of {HICACHE_WRITE_POLICIES}, "
                                      f"got {self.hicache_write_policy!r}")
        if not self.hicache_storage_max_gb > 0:
            raise InvalidRequestError(f"hicache_storage_max_gb must be positive, got {self.hicache_storage_max_gb}")
        if self.hicache_storage_dir is not None and not self.hicache_storage_dir.strip():
            raise InvalidRequestError("hicache_storage_dir must not be empty (leave it out for the default folder)")

"""The KV cache's configuration: its blocks (pages), the pool's size and prefix caching."""

from __future__ import annotations

from dataclasses import dataclass

from chunkserve.config.fields import arg, human_readable_int
from chunkserve.errors import InvalidRequestError


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = arg(16, "tokens per KV cache block (page)", aliases=("--page-size",))
    kv_cache_memory_gb: float = arg(2.0, "memory for the KV cache pool, GiB")
    kv_cache_memory_bytes: int | None = arg(
        None, "memory for the KV cache pool in bytes, e.g. 4G (overrides --kv-cache-memory-gb)", type=human_readable_int
    )
    num_kv_blocks: int | None = arg(
        None, "exact number of KV blocks (overrides --kv-cache-memory-gb)", aliases=("--num-gpu-blocks-override",)
    )
    enable_prefix_caching: bool = arg(
        True, "reuse the KV of full blocks shared with earlier requests (a SHA-256 hash chain over their tokens)",
        negative_aliases=("--disable-radix-cache",)
    )

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise InvalidRequestError(f"block_size must be positive, got {self.block_size}")
        if self.kv_cache_memory_gb <= 0:
            raise InvalidRequestError("kv_cache_memory_gb must be positive")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise InvalidRequestError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise InvalidRequestError("num_kv_blocks must be positive")

    @property
    def kv_cache_bytes(self) -> int:
        """The KV pool's memory: --kv-cache-memory-bytes, else --kv-cache-memory-gb."""
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        return int(self.kv_cache_memory_gb * 2**30)

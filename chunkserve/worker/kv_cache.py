"""The KV cache tensors, their sizing from a memory budget, and block payloads in and out.

The pool is one tensor `[layers, 2 (K, V), slots, kv_heads, head_dim]`, slot = block_id *
block_size + offset. A block's payload (core/kv/layout.py) is its slots of every layer in that
order, so reading blocks out is one gather and writing them back one scatter."""

from __future__ import annotations

import torch

from chunkserve.model.config import ModelConfig


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token in every layer."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * element


def num_blocks_for_memory(bytes_per_token: int, memory_bytes: int, block_size: int) -> int:
    return memory_bytes // (bytes_per_token * block_size)


def allocate_kv_pool(config: ModelConfig, dtype: torch.dtype, num_blocks: int, block_size: int) -> torch.Tensor:
    """Zero-filled, so that padded (masked) decode keys never hold NaN garbage."""
    return torch.zeros(config.num_layers, 2, num_blocks * block_size, config.num_kv_heads, config.head_dim,
                       dtype=dtype)


def layer_caches(pool: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer, each `[slots, kv_heads, head_dim]`, views of the pool."""
    return [(pool[i, 0], pool[i, 1]) for i in range(pool.shape[0])]


def allocate_kv_cache(config: ModelConfig, dtype: torch.dtype, num_blocks: int,
                      block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return layer_caches(allocate_kv_pool(config, dtype, num_blocks, block_size))


def _blocks_view(pool: torch.Tensor, block_size: int) -> torch.Tensor:
    layers, _, slots, heads, dim = pool.shape
    return pool.view(layers, 2, slots // block_size, block_size, heads, dim)


def read_blocks(pool: torch.Tensor, block_ids: list[int], block_size: int) -> list[bytes]:
    """The payloads of `block_ids`, in order."""
    if not block_ids:
        return []
    gathered = _blocks_view(pool, block_size)[:, :, block_ids].permute(2, 0, 1, 3, 4, 5).contiguous()
    as_bytes = gathered.view(torch.uint8).reshape(len(block_ids), -1).numpy()
    return [row.tobytes() for row in as_bytes]


def write_blocks(pool: torch.Tensor, block_ids: list[int], block_size: int, payloads: list[bytes]) -> None:
    """Overwrite `block_ids` with `payloads` (each exactly one block's bytes)."""
    if not block_ids:
        return
    view = _blocks_view(pool, block_size)
    layers, _, _, size, heads, dim = view.shape
    staged = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).view(pool.dtype)
    staged = staged.view(len(block_ids), layers, 2, size, heads, dim).permute(1, 2, 0, 3, 4, 5)
    view[:, :, block_ids] = staged

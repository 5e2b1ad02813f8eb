"""The KV cache tensors and their sizing from a memory budget."""

from __future__ import annotations

import torch

from chunkserve.model.config import ModelConfig

_GIB = 1 << 30


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token in every layer."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * element


def num_blocks_for_memory(config: ModelConfig, dtype: torch.dtype, memory_gb: float, block_size: int) -> int:
    return int(memory_gb * _GIB) // (kv_bytes_per_token(config, dtype) * block_size)


def allocate_kv_cache(config: ModelConfig, dtype: torch.dtype, num_blocks: int,
                      block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer, each `[num_blocks * block_size, kv_heads, head_dim]`:
    a flat pool of slots, slot = block_id * block_size + offset.

    Zero-filled, so that padded (masked) decode keys never hold NaN garbage."""
    num_slots = num_blocks * block_size
    pool = torch.zeros(config.num_layers, 2, num_slots, config.num_kv_heads, config.head_dim, dtype=dtype)
    return [(pool[i, 0], pool[i, 1]) for i in range(config.num_layers)]

"""Attention over the paged KV cache for a flattened mixed batch (torch SDPA backend).

The flat batch puts decode rows first, then each prefill chunk:

    rows   | d0 d1 d2 | p0 p0 p0 p0 | p1 p1 |
           decodes      chunk of p0   chunk of p1

Decodes are attended in groups of similar context length. With the C++ op
(ops/cpp_ops.py) each decode reads its own keys in place through its block table; the
plain-torch path (the reference) gathers each group's keys, padded to its longest and masked
(a group's longest is at most twice its shortest, so one long-context decode does not make
every short one read thousands of padded keys). Each prefill chunk is attended on its
own, its queries at positions [c, c+n) seeing keys [0, c + i] (the earlier chunks from the
cache plus its own keys, causally): with the C++ op in place through its block table, on the
plain-torch path by gathering its keys for SDPA.

The cache is float32, or bfloat16 in bfloat16 mode: keys and values are rounded to it as they
are written, and widened back to float32 as they are read (q, the softmax and the output stay
float32 on both paths).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chunkserve.core.kv_connector import KVConnectorWorker
from chunkserve.ops.cpp_ops import AttentionKernels


@dataclass
class PrefillChunk:
    row_start: int  # first row of the chunk in the flat batch
    num_rows: int
    start: int  # position of its first query (c): tokens of the prompt already in the cache
    block_table: torch.Tensor  # [blocks] the request's blocks holding positions 0 .. c+n-1
    key_slots: torch.Tensor | None = None  # [context_len] KV slots of positions 0 .. c+n-1 (gathering path)
    mask: torch.Tensor | None = None  # [num_rows, context_len] True = attend; None = plain causal (c == 0)


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # [B] rows of the flat batch (decode rows come first)
    block_tables: torch.Tensor  # [B, max_blocks] each decode's blocks, padded with block 0
    context_lens: torch.Tensor  # [B] keys each decode attends
    key_slots: torch.Tensor | None = None  # [B, max_len] KV slots of each decode's keys, padded with slot 0
    mask: torch.Tensor | None = None  # [B, 1, 1, max_len] True = a real key (both None for the in-place op)


@dataclass
class AttentionMetadata:
    """Built once per step by the input batch, read by every layer."""

    slot_mapping: torch.Tensor  # [T] where each row's new K/V is written
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    block_size: int
    kernels: AttentionKernels | None = None  # the in-place C++ ops; None: gather in torch
    kv_connector: KVConnectorWorker | None = None  # told when each layer's KV may be read and was written

    def in_place_decode_group(self) -> DecodeGroup | None:
        """The one group of a pure decode step that the C++ op attends in place (every row a
        decode), or None for any other step."""
        if self.kernels is None or self.prefills or len(self.decode_groups) != 1:
            return None
        return self.decode_groups[0]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Store this step's keys and values (`[T, kv_heads, head_dim]`) at their slots, in the cache's dtype."""
    k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, heads, head_dim]; caches: [num_slots, kv_heads, head_dim] -> [T, heads, head_dim]."""
    in_place = meta.kernels is not None and bool(meta.decode_groups)
    if in_place and not meta.prefills:
        return _decode_in_place(q, k_cache, v_cache, meta, scale)  # a pure decode step: no copy of the output
    out = torch.empty_like(q)
    if in_place:
        decodes = _decode_in_place(q, k_cache, v_cache, meta, scale)
        out[: decodes.shape[0]] = decodes
    else:
        for group in meta.decode_groups:
            keys = k_cache[group.key_slots].to(q.dtype).transpose(1, 2)  # (B, kv_heads, L, D)
            values = v_cache[group.key_slots].to(q.dtype).transpose(1, 2)
            queries = q[group.rows].unsqueeze(2)  # (B, heads, 1, D)
            attended = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=group.mask, scale=scale, enable_gqa=True
            )
            out[group.rows] = attended.squeeze(2)
    for chunk in meta.prefills:
        rows = slice(chunk.row_start, chunk.row_start + chunk.num_rows)
        if meta.kernels is not None:
            out[rows] = meta.kernels.prefill(q[rows], k_cache, v_cache, chunk.block_table, chunk.start,
                                             meta.block_size, scale)
            continue
        keys = k_cache[chunk.key_slots].to(q.dtype).transpose(0, 1).unsqueeze(0)  # (1, kv_heads, ctx, D)
        values = v_cache[chunk.key_slots].to(q.dtype).transpose(0, 1).unsqueeze(0)
        queries = q[rows].transpose(0, 1).unsqueeze(0)  # (1, heads, n, D)
        attended = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=scale, enable_gqa=True
        )
        out[rows] = attended.squeeze(0).transpose(0, 1)
    return out


def _decode_in_place(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The C++ op over the one group of every decode, rows 0 .. B-1 (a slice, not an index copy)."""
    (group,) = meta.decode_groups
    return meta.kernels.decode(q[: len(group.context_lens)], k_cache, v_cache, group.block_tables,
                              group.context_lens, meta.block_size, scale)

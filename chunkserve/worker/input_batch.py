"""SchedulerOutput -> ForwardBatch: the flat tensors one forward pass needs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from chunkserve.attention.paged import AttentionMetadata, DecodeGroup, PrefillChunk
from chunkserve.core.messages import ScheduledRequest
from chunkserve.ops.cpp_ops import AttentionKernels


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [R] rows whose hidden state is turned into logits
    sample_request_ids: list[str]  # the requests that sample, in row order
    first_rows: dict[str, int]  # each request's first row (position num_computed_tokens)


def build_forward_batch(scheduled: list[ScheduledRequest], token_ids: Mapping[str, list[int]],
                        block_tables: Mapping[str, np.ndarray], block_size: int,
                        kernels: AttentionKernels | None = None) -> ForwardBatch:
    """Flatten the step. Single-token rows (decodes) go first and are attended together:
    all in one call of `kernels.decode`, which reads their blocks in place, or without
    kernels in groups of similar context length; longer chunks follow, each attended on its
    own: by `kernels.prefill` through its block table, or without kernels over its gathered keys.

    `token_ids[request_id]` is the request's whole token list (prompt + output so far), and
    `block_tables[request_id]` its block ids (the worker's copy, kept up to date from the
    scheduler's diffs). A decode's draft tokens follow its last token in its rows, and all of
    its rows are sampled.
    """
    singles = [s for s in scheduled if s.num_scheduled_tokens == 1]
    chunks = [s for s in scheduled if s.num_scheduled_tokens > 1]
    ordered = singles + chunks

    input_ids: list[int] = []
    positions: list[np.ndarray] = []
    slots: list[np.ndarray] = []
    logits_rows: list[int] = []
    sample_ids: list[str] = []
    prefills: list[PrefillChunk] = []
    first_rows: dict[str, int] = {}
    row = 0
    for s in ordered:
        first_rows[s.request_id] = row
        start, count = s.num_computed_tokens, s.num_scheduled_tokens
        num_known = count - len(s.draft_token_ids)
        input_ids.extend(token_ids[s.request_id][start : start + num_known])
        input_ids.extend(s.draft_token_ids)
        table = block_tables[s.request_id]
        new_positions = np.arange(start, start + count, dtype=np.int64)
        positions.append(new_positions)
        slots.append(_slots_of(table, new_positions, block_size))
        if count > 1:
            prefills.append(_prefill_chunk(row, start, count, table, block_size, gather=kernels is None))
        row += count
        if s.sample:
            logits_rows.extend(range(row - s.num_sampled_rows, row))
            sample_ids.append(s.request_id)

    attn = AttentionMetadata(
        slot_mapping=torch.from_numpy(np.concatenate(slots)),
        decode_groups=_decode_groups(singles, block_tables, block_size, gather=kernels is None),
        prefills=prefills,
        block_size=block_size,
        kernels=kernels,
    )
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        positions=torch.from_numpy(np.concatenate(positions)),
        attn=attn,
        logits_indices=torch.tensor(logits_rows, dtype=torch.long),
        sample_request_ids=sample_ids,
        first_rows=first_rows,
    )


def _slots_of(block_table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """block_size 4, table [7, 2], positions [0..5] -> [28, 29, 30, 31, 8, 9]"""
    return block_table[positions // block_size] * block_size + positions % block_size


def _prefill_chunk(row: int, start: int, count: int, block_table: np.ndarray, block_size: int,
                   gather: bool) -> PrefillChunk:
    """A chunk's rows row .. row+count-1 at positions start .. start+count-1 and its block table;
    when `gather` (no kernels: SDPA over the gathered keys 0 .. start+count-1), also the keys'
    slots and the chunk's mask."""
    chunk_table = torch.from_numpy(block_table[: -(-(start + count) // block_size)])
    if not gather:
        return PrefillChunk(row, count, start, chunk_table)
    context_slots = _slots_of(block_table, np.arange(start + count, dtype=np.int64), block_size)
    return PrefillChunk(row, count, start, chunk_table, torch.from_numpy(context_slots), _chunk_mask(start, count))


def _chunk_mask(start: int, count: int) -> torch.Tensor | None:
    """Queries at positions start..start+count-1 see keys 0..their own position.
    start 2, count 2 -> [[1,1,1,0], [1,1,1,1]]; None (plain causal) when start == 0."""
    if start == 0:
        return None
    keys = torch.arange(start + count)
    queries = torch.arange(start, start + count)
    return keys[None, :] <= queries[:, None]


MAX_DECODE_PADDING_RATIO = 2


def group_by_context(singles: list[ScheduledRequest]) -> list[list[int]]:
    """Indices of the single-token rows, grouped so that in each group the longest context is
    at most MAX_DECODE_PADDING_RATIO times the shortest: padding to the longest then wastes at
    most half of a group's key reads. Context lengths [5, 100, 7, 180] -> [[0, 2], [1, 3]]."""
    order = sorted(range(len(singles)), key=lambda i: singles[i].num_computed_tokens)
    groups: list[list[int]] = []
    for i in order:
        context_len = singles[i].num_computed_tokens + 1
        if groups and context_len <= MAX_DECODE_PADDING_RATIO * (singles[groups[-1][0]].num_computed_tokens + 1):
            groups[-1].append(i)
        else:
            groups.append([i])
    return [sorted(group) for group in groups]


def _decode_groups(singles: list[ScheduledRequest], block_tables: Mapping[str, np.ndarray], block_size: int,
                   gather: bool) -> list[DecodeGroup]:
    """One group of every decode for the in-place op; for the gathering path, groups of
    similar context length with their key slots."""
    if not singles:
        return []
    if not gather:
        return [_decode_group(singles, list(range(len(singles))), block_tables, block_size, gather)]
    return [_decode_group(singles, rows, block_tables, block_size, gather) for rows in group_by_context(singles)]


def _decode_group(singles: list[ScheduledRequest], rows: list[int], block_tables: Mapping[str, np.ndarray],
                  block_size: int, gather: bool) -> DecodeGroup:
    """Block tables `[B, max_blocks]` and context lengths of the group's single-token rows;
    when `gather`, also their key slots `[B, max_len]`, padded with slot 0, and the mask
    `[B, 1, 1, max_len]` of real keys. Context lengths [3, 1] -> mask [[1,1,1],[1,0,0]]."""
    members = [singles[i] for i in rows]
    context_lens = np.array([s.num_computed_tokens + 1 for s in members], dtype=np.int64)
    max_len = int(context_lens.max())
    max_blocks = -(-max_len // block_size)
    tables = np.zeros((len(members), max_blocks), dtype=np.int64)
    for i, s in enumerate(members):
        used = block_tables[s.request_id][:max_blocks]
        tables[i, : len(used)] = used
    row_ids = torch.tensor(rows, dtype=torch.long)
    block_tables, lens = torch.from_numpy(tables), torch.from_numpy(context_lens)
    if not gather:
        return DecodeGroup(row_ids, block_tables, lens)
    key_positions = np.arange(max_len, dtype=np.int64)
    key_slots = tables[:, key_positions // block_size] * block_size + key_positions % block_size
    mask = key_positions[None, :] < context_lens[:, None]
    key_slots = np.where(mask, key_slots, 0)
    return DecodeGroup(row_ids, block_tables, lens, torch.from_numpy(key_slots),
                       torch.from_numpy(mask)[:, None, None, :])

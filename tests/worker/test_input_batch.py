"""How the flat batch groups decodes for attention."""

from __future__ import annotations

import torch

from chunkserve.core.messages import ScheduledRequest
from chunkserve.worker.input_batch import build_forward_batch, group_by_context
from tests.paged_runner import tables_of

BLOCK_SIZE = 4


def decode(request_id: str, context_len: int) -> ScheduledRequest:
    blocks = list(range(100, 100 + -(-context_len // BLOCK_SIZE)))
    return ScheduledRequest(request_id, context_len - 1, 1, blocks, True, True, True)



def test_decodes_are_grouped_so_padding_stays_under_half():
    singles = [decode(f"r{i}", n) for i, n in enumerate([6, 101, 8, 181, 5, 2000])]
    assert group_by_context(singles) == [[0, 2, 4], [1, 3], [5]]


def test_each_decode_group_reads_only_its_own_longest_context():
    singles = [decode("short", 6), decode("long", 2000), decode("short2", 8)]
    tokens = {s.request_id: list(range(s.num_computed_tokens + 1)) for s in singles}
    batch = build_forward_batch(singles, tokens, tables_of(singles), BLOCK_SIZE)
    shapes = {tuple(g.rows.tolist()): tuple(g.key_slots.shape) for g in batch.attn.decode_groups}
    assert shapes == {(0, 2): (2, 8), (1,): (1, 2000)}
    short = next(g for g in batch.attn.decode_groups if g.rows.tolist() == [0, 2])
    assert short.mask[:, 0, 0, :].sum(dim=1).tolist() == [6, 8]
    assert torch.equal(short.key_slots[0, :6], torch.arange(400, 406))  # block 100 * 4 onwards, padding after

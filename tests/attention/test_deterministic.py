"""Deterministic attention (`attention_kernels(deterministic=True)`, issue 42): a query row at
position p gives the same bits whether it decodes alone, decodes beside other decodes, or is row
p - s of a prefill chunk (s, n) of any start and length, at any place of the flat batch; over a
float32 or a bfloat16 cache, blocks of 16, 1 and 80; and stays close to the plain-torch reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chunkserve.attention.paged import paged_attention
from chunkserve.core.messages import ScheduledRequest
from chunkserve.worker.input_batch import build_forward_batch

HEADS, KV_HEADS, HEAD_DIM, SCALE = 9, 3, 64, 0.125  # SmolLM2-135M's attention
LENGTH = 200  # positions of the sequence under test: key tiles 0, 64, 128 and a partial one
POSITIONS = [0, 5, 63, 64, 65, 127, 130, 199]  # tile edges, micro-tile places 0..5 across GQA rows
CHUNKS = [(0, LENGTH), (0, 1), (0, 66), (3, 7), (60, 8), (64, 64), (100, 100), (127, 4), (129, 2), (199, 1),
          (1, 199), (50, 130)]  # (start, rows)


class Sequence:
    """One request's queries at every position, and its keys and values in a paged cache whose
    other slots hold other requests' keys."""

    def __init__(self, kv_dtype: torch.dtype, block_size: int) -> None:
        generator = torch.Generator().manual_seed(42)
        num_blocks = 2 * -(-LENGTH // block_size) + 4
        self.k_cache = torch.randn(num_blocks * block_size, KV_HEADS, HEAD_DIM, generator=generator).to(kv_dtype)
        self.v_cache = torch.randn(num_blocks * block_size, KV_HEADS, HEAD_DIM, generator=generator).to(kv_dtype)
        self.q = torch.randn(LENGTH, HEADS, HEAD_DIM, generator=generator)
        self.blocks = [int(b) for b in np.random.default_rng(7).permutation(num_blocks)]
        self.table = self.blocks[: -(-LENGTH // block_size)]
        self.block_size = block_size

    def decodes(self, kernels, positions: list[int]) -> torch.Tensor:
        """Decode rows at `positions`, all in one call of the decode op."""
        tables = torch.tensor([self.table] * len(positions))
        return kernels.decode(self.q[positions], self.k_cache, self.v_cache, tables,
                              torch.tensor([p + 1 for p in positions]), self.block_size, SCALE)

    def chunk(self, kernels, start: int, rows: int) -> torch.Tensor:
        return kernels.prefill(self.q[start: start + rows], self.k_cache, self.v_cache, torch.tensor(self.table),
                               start, self.block_size, SCALE)


@pytest.fixture(params=[(torch.float32, 16), (torch.bfloat16, 16), (torch.float32, 1), (torch.bfloat16, 80)],
                ids=["f32-16", "bf16-16", "f32-1", "bf16-80"])
def sequence(request) -> Sequence:
    return Sequence(*request.param)


def test_a_row_has_the_same_bits_on_every_path(cpp_ops, cpu_isa, sequence):
    """Alone, beside other decodes of other lengths at any place of the call, and at every row
    of every chunk that covers it (chunks of 1 to 200 rows starting at and between key tiles)."""
    kernels = cpp_ops.attention_kernels(deterministic=True)
    alone = {p: sequence.decodes(kernels, [p])[0] for p in POSITIONS}
    crowd = [7, 199, 0, 64, 130, 5, 150, 63, 127, 65, 33]  # 11 decodes of 1 to 200 keys, each once
    for p, row in zip(crowd, sequence.decodes(kernels, crowd)):
        if p in alone:
            assert torch.equal(row, alone[p]), f"decode at {p} beside others"
    for start, rows in CHUNKS:
        out = sequence.chunk(kernels, start, rows)
        for p in POSITIONS:
            if start <= p < start + rows:
                assert torch.equal(out[p - start], alone[p]), f"row {p - start} of chunk ({start}, {rows})"


def test_the_rows_are_close_to_the_torch_reference(cpp_ops, sequence):
    kernels = cpp_ops.attention_kernels(deterministic=True)
    keys = sequence.k_cache[_slots(sequence)].float().transpose(0, 1)  # (kv_heads, L, D)
    values = sequence.v_cache[_slots(sequence)].float().transpose(0, 1)
    reference = torch.nn.functional.scaled_dot_product_attention(
        sequence.q.transpose(0, 1), keys, values, is_causal=True, scale=SCALE, enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(sequence.chunk(kernels, 0, LENGTH), reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sequence.decodes(kernels, POSITIONS), reference[POSITIONS], rtol=1e-5, atol=1e-5)


def test_a_row_has_the_same_bits_wherever_the_flat_batch_puts_it(cpp_ops):
    """Through `paged_attention`: the request under test decodes first among other decodes, then
    sits in a chunk after other chunks, in steps built as the worker builds them."""
    sequence = Sequence(torch.float32, 16)
    kernels = cpp_ops.attention_kernels(deterministic=True)
    p = 130
    decode_step = [_request("other-a", 40, 1, sequence), _request("x", p, 1, sequence), _request("other-b", 9, 1, sequence)]
    chunk_step = [_request("other-c", 0, 30, sequence), _request("other-d", 70, 1, sequence),
                  _request("x", p - 10, 20, sequence)]
    rows = {}
    for name, scheduled in (("decode", decode_step), ("chunk", chunk_step)):
        flat = [s for s in scheduled if s.num_scheduled_tokens == 1] + \
            [s for s in scheduled if s.num_scheduled_tokens > 1]  # the flat batch's order: decodes first
        q = torch.cat([sequence.q[s.num_computed_tokens: s.num_computed_tokens + s.num_scheduled_tokens]
                       for s in flat])
        tokens = {s.request_id: [0] * (s.num_computed_tokens + s.num_scheduled_tokens) for s in scheduled}
        tables = {s.request_id: np.asarray(sequence.table, dtype=np.int64) for s in scheduled}
        meta = build_forward_batch(scheduled, tokens, tables, sequence.block_size, kernels).attn
        out = paged_attention(q, sequence.k_cache, sequence.v_cache, meta, SCALE)
        first_row = sum(s.num_scheduled_tokens for s in flat[: [s.request_id for s in flat].index("x")])
        x = next(s for s in flat if s.request_id == "x")
        rows[name] = out[first_row + p - x.num_computed_tokens]
    assert torch.equal(rows["decode"], rows["chunk"])


def _request(request_id: str, start: int, count: int, sequence: Sequence) -> ScheduledRequest:
    """A request reading the sequence's blocks (as a prefix-cache hit shares them)."""
    return ScheduledRequest(request_id, start, count, sequence.table, True, True, count == 1)


def _slots(sequence: Sequence) -> torch.Tensor:
    positions = torch.arange(LENGTH)
    return torch.tensor(sequence.table)[positions // sequence.block_size] * sequence.block_size \
        + positions % sequence.block_size

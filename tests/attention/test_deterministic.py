"""Deterministic attention (`attention_kernels(deterministic=True)`, issue 42): a query row at
position p gives the same bits whether it decodes alone, decodes beside other decodes, or is row
p - s of a prefill chunk (s, n) of any start and length, at any place of the flat batch; over a
float32 or a bfloat16 cache, blocks of 16, 1 and 80, GQA groups of 1 to 5 and heads of 32 to 128;
and stays close to the plain-torch reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chunkserve.attention.paged import paged_attention
from chunkserve.worker.input_batch import build_forward_batch
from tests.attention.support import (
    LENGTH,
    POSITIONS,
    SCALE,
    SHAPES,
    Sequence,
    assert_same_bits_on_every_path,
    key_slots,
    request_on,
)


@pytest.fixture(params=[(torch.float32, 16), (torch.bfloat16, 16), (torch.float32, 1), (torch.bfloat16, 80)],
                ids=["f32-16", "bf16-16", "f32-1", "bf16-80"])
def sequence(request) -> Sequence:
    return Sequence(*request.param)


def test_a_row_has_the_same_bits_on_every_path(cpp_ops, cpu_isa, sequence):
    """Alone, beside other decodes of other lengths at any place of the call, and at every row
    of every chunk that covers it (chunks of 1 to 200 rows starting at and between key tiles)."""
    assert_same_bits_on_every_path(cpp_ops.attention_kernels(deterministic=True), sequence)


@pytest.mark.parametrize("shape", SHAPES[1:], ids=str)
def test_every_head_shape_has_the_same_bits_on_every_path(cpp_ops, cpu_isa, shape):
    assert_same_bits_on_every_path(cpp_ops.attention_kernels(deterministic=True), Sequence(torch.bfloat16, 16, shape))


def test_the_rows_are_close_to_the_torch_reference(cpp_ops, sequence):
    kernels = cpp_ops.attention_kernels(deterministic=True)
    keys = sequence.k_cache[key_slots(sequence)].float().transpose(0, 1)  # (kv_heads, L, D)
    values = sequence.v_cache[key_slots(sequence)].float().transpose(0, 1)
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
    decode_step = [request_on("other-a", 40, 1, sequence), request_on("x", p, 1, sequence), request_on("other-b", 9, 1, sequence)]
    chunk_step = [request_on("other-c", 0, 30, sequence), request_on("other-d", 70, 1, sequence),
                  request_on("x", p - 10, 20, sequence)]
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

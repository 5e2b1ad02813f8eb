"""The in-place C++ attention ops (decode and prefill chunks) against the plain-torch attention
(the reference, which gathers the keys for SDPA), over a float32 or a bfloat16 KV cache; and the
bfloat16 cache's per-op accuracy contract against float32 (tests/ops/support.py's measure)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chunkserve.attention.paged import paged_attention
from chunkserve.core.messages import ScheduledRequest
from chunkserve.ops.cpp_ops import AMX_PREFILL_MIN_CONTEXT
from chunkserve.worker.input_batch import build_forward_batch
from tests.ops.support import NMSE_BOUND, nmse
from tests.paged_runner import tables_of

BLOCK_SIZE = 16
KV_DTYPES = [torch.float32, torch.bfloat16]


def decode_step(heads: int, kv_heads: int, head_dim: int, block_size: int = BLOCK_SIZE):
    """(q, k_cache, v_cache, scheduled, tokens) of a decode step at contexts from 1 to 1000."""
    rng = np.random.default_rng(0)
    num_blocks = -(-3200 // block_size)
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim)
    blocks = list(rng.permutation(num_blocks))
    scheduled = []
    for i, context_len in enumerate([1, 5, 16, 17, 300, 1000, 33]):
        table = [int(blocks.pop()) for _ in range(-(-context_len // block_size))]
        scheduled.append(ScheduledRequest(f"r{i}", context_len - 1, 1, table, True, True, True))
    tokens = {s.request_id: [0] * (s.num_computed_tokens + 1) for s in scheduled}
    q = torch.randn(len(scheduled), heads, head_dim)
    return q, k_cache, v_cache, scheduled, tokens


def mixed_step(heads: int, kv_heads: int, head_dim: int, block_size: int):
    """(q, k_cache, v_cache, scheduled, tokens) of prefill chunks and decodes in one step."""
    rng = np.random.default_rng(1)
    generator = torch.Generator().manual_seed(1)
    num_blocks = -(-6400 // block_size)
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=generator)
    blocks = list(rng.permutation(num_blocks))
    scheduled = []
    for i, (start, count) in enumerate([(40, 1), (0, 2), (0, 37), (5, 11), (16, 16), (100, 300), (1000, 65),
                                        (63, 130), (700, 1)]):
        table = [int(blocks.pop()) for _ in range(-(-(start + count) // block_size))]
        scheduled.append(ScheduledRequest(f"r{i}", start, count, table, True, True, count == 1))
    tokens = {s.request_id: [0] * (s.num_computed_tokens + s.num_scheduled_tokens) for s in scheduled}
    q = torch.randn(sum(s.num_scheduled_tokens for s in scheduled), heads, head_dim, generator=generator)
    return q, k_cache, v_cache, scheduled, tokens


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size",
                         [(9, 3, 64, 16), (4, 4, 32, 16), (8, 2, 128, 16), (8, 1, 64, 16), (10, 2, 64, 16),
                          (9, 3, 64, 80), (9, 3, 64, 1)])
def test_in_place_decode_equals_the_torch_reference(cpp_ops, cpu_isa, heads, kv_heads, head_dim, block_size,
                                                    kv_dtype):
    """Over a bfloat16 cache too: both read it widened to float32, so float32 tolerances hold.
    GQA groups of 1 to 8 (8 and 5: the AVX-512 path's three-head tiles and a remainder), heads
    of 64 (that path) and others, blocks of 16 keys (one 512-bit register of scores), more
    (several per block) and one; with each instruction set the CPU has."""
    q, k_cache, v_cache, scheduled, tokens = decode_step(heads, kv_heads, head_dim, block_size)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    tables = tables_of(scheduled)
    reference = paged_attention(q, k_cache, v_cache, build_forward_batch(scheduled, tokens, tables, block_size).attn,
                                0.125)
    batch = build_forward_batch(scheduled, tokens, tables, block_size, cpp_ops.attention_kernels(amx=False))
    in_place = paged_attention(q, k_cache, v_cache, batch.attn, 0.125)
    torch.testing.assert_close(in_place, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size",
                         [(9, 3, 64, 16), (4, 4, 32, 16), (8, 2, 128, 16), (6, 3, 40, 16), (8, 1, 64, 16),
                          (10, 2, 64, 80), (9, 3, 64, 1)])
def test_in_place_prefill_chunks_equal_the_torch_reference(cpp_ops, cpu_isa, heads, kv_heads, head_dim, block_size,
                                                           kv_dtype):
    """Chunks from the first position and after a history, shorter and longer than a key tile
    (64) and a position tile (128), ending mid-block, beside decodes in one mixed step; GQA
    groups of 1 to 8 (5: not a divisor of the op's 6-row micro-tiles), head sizes with and
    without a 64-column (AVX-512) or 32-column (AVX2) value tail, blocks smaller than, and not
    dividing, a key tile; with each instruction set the CPU has."""
    q, k_cache, v_cache, scheduled, tokens = mixed_step(heads, kv_heads, head_dim, block_size)
    k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
    reference_batch = build_forward_batch(scheduled, tokens, tables_of(scheduled), block_size)
    reference = paged_attention(q, k_cache, v_cache, reference_batch.attn, 0.125)
    kernels = cpp_ops.attention_kernels(amx=False)
    batch = build_forward_batch(scheduled, tokens, tables_of(scheduled), block_size, kernels)
    assert all(chunk.key_slots is None and chunk.mask is None for chunk in batch.attn.prefills)  # nothing gathered
    in_place = paged_attention(q, k_cache, v_cache, batch.attn, 0.125)
    if kv_dtype == torch.bfloat16 and bf16_products(cpp_ops, cpu_isa, head_dim):
        # the chunks' products in bfloat16: against the reference on the same bfloat16 queries, the
        # probabilities' rounding apart; and within the per-op bound of the float32 queries' result
        rounded_queries = paged_attention(q.bfloat16().float(), k_cache, v_cache, reference_batch.attn, 0.125)
        torch.testing.assert_close(in_place, rounded_queries, rtol=0, atol=1e-2)
        assert nmse(in_place, reference) < NMSE_BOUND
    else:
        torch.testing.assert_close(in_place, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(9, 3, 64, 16), (8, 2, 128, 16), (10, 2, 64, 80)])
def test_amx_prefill_chunks_are_within_the_bound_of_the_torch_reference(cpp_ops, heads, kv_heads, head_dim,
                                                                        block_size):
    """The prefill path of a CPU with AMX (torch's flash attention in bfloat16 over the gathered
    keys for chunks of AMX_PREFILL_MIN_CONTEXT keys or more, the C++ op for shorter ones; it runs
    on any CPU, so it is checked on every one): over a bfloat16 cache, chunks of both kinds beside
    decodes, against the reference on the same bfloat16 queries (the probabilities' and the
    output's roundings apart) and within the per-op bound of the float32 queries' result; over a
    float32 cache it is the C++ op, bit for bit."""
    q, k_cache, v_cache, scheduled, tokens = mixed_step(heads, kv_heads, head_dim, block_size)
    contexts = [s.num_computed_tokens + s.num_scheduled_tokens for s in scheduled if s.num_scheduled_tokens > 1]
    assert min(contexts) < AMX_PREFILL_MIN_CONTEXT <= max(contexts)
    amx_kernels, cpp_kernels = cpp_ops.attention_kernels(amx=True), cpp_ops.attention_kernels(amx=False)
    batch = build_forward_batch(scheduled, tokens, tables_of(scheduled), block_size, amx_kernels)
    cpp_batch = build_forward_batch(scheduled, tokens, tables_of(scheduled), block_size, cpp_kernels)
    assert torch.equal(paged_attention(q, k_cache, v_cache, batch.attn, 0.125),
                       paged_attention(q, k_cache, v_cache, cpp_batch.attn, 0.125))
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    reference_batch = build_forward_batch(scheduled, tokens, tables_of(scheduled), block_size)
    reference = paged_attention(q, k_cache, v_cache, reference_batch.attn, 0.125)
    rounded_queries = paged_attention(q.bfloat16().float(), k_cache, v_cache, reference_batch.attn, 0.125)
    amx = paged_attention(q, k_cache, v_cache, batch.attn, 0.125)
    torch.testing.assert_close(amx, rounded_queries, rtol=1e-2, atol=1e-2)
    assert nmse(amx, reference) < NMSE_BOUND


def bf16_products(cpp_ops, cpu_isa: str, head_dim: int) -> bool:
    """Whether the prefill op multiplies a bfloat16 cache's chunks in bfloat16 (csrc/prefill_attention.cpp)."""
    return cpu_isa == "avx512" and cpp_ops.bf16_dot_supported() and head_dim % 64 == 0


@pytest.mark.parametrize("step", ["decode", "mixed"])
def test_bf16_kv_attention_is_within_the_bound_of_float32(cpp_ops, step):
    """The C++ ops over the bfloat16 rounding of a cache against the same ops over the float32
    cache (SmolLM2's heads: 9 over 3 kv heads of 64); the prefill chunks' products in bfloat16
    where the CPU has AVX512_BF16."""
    q, k_cache, v_cache, scheduled, tokens = decode_step(9, 3, 64) if step == "decode" else mixed_step(9, 3, 64, 16)
    kernels = cpp_ops.attention_kernels(amx=False)
    attn = build_forward_batch(scheduled, tokens, tables_of(scheduled), BLOCK_SIZE, kernels).attn
    float32 = paged_attention(q, k_cache, v_cache, attn, 0.125)
    bf16 = paged_attention(q, k_cache.bfloat16(), v_cache.bfloat16(), attn, 0.125)
    assert bf16.dtype == torch.float32 and nmse(bf16, float32) < NMSE_BOUND


def test_in_place_prefill_refuses_a_block_outside_the_cache(cpp_ops):
    k_cache = v_cache = torch.zeros(4 * BLOCK_SIZE, 1, 8)
    with pytest.raises(RuntimeError, match="block id outside the cache"):
        cpp_ops.prefill_attention(torch.zeros(3, 1, 8), k_cache, v_cache, torch.tensor([4]), 0, BLOCK_SIZE, 1.0)


def test_in_place_decode_refuses_a_block_outside_the_cache(cpp_ops):
    k_cache = v_cache = torch.zeros(4 * BLOCK_SIZE, 1, 8)
    with pytest.raises(RuntimeError, match="block id outside the cache"):
        cpp_ops.decode_attention(torch.zeros(1, 1, 8), k_cache, v_cache, torch.tensor([[7]]), torch.tensor([3]),
                                 BLOCK_SIZE, 1.0)

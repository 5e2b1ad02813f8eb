"""The in-place C++ decode op against the plain-torch attention (the reference)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chunkserve.core.scheduler_output import ScheduledRequest
from chunkserve.worker.attention import paged_attention
from chunkserve.worker.input_batch import build_forward_batch

BLOCK_SIZE = 16


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_in_place_decode_equals_the_torch_reference(cpp_ops, heads, kv_heads, head_dim):
    rng = np.random.default_rng(0)
    num_blocks = 200
    k_cache = torch.randn(num_blocks * BLOCK_SIZE, kv_heads, head_dim)
    v_cache = torch.randn(num_blocks * BLOCK_SIZE, kv_heads, head_dim)
    blocks = list(rng.permutation(num_blocks))
    scheduled = []
    for i, context_len in enumerate([1, 5, 16, 17, 300, 1000, 33]):
        table = [int(blocks.pop()) for _ in range(-(-context_len // BLOCK_SIZE))]
        scheduled.append(ScheduledRequest(f"r{i}", context_len - 1, 1, table, True, True))
    tokens = {s.request_id: [0] * (s.num_computed_tokens + 1) for s in scheduled}
    q = torch.randn(len(scheduled), heads, head_dim)
    reference = paged_attention(q, k_cache, v_cache, build_forward_batch(scheduled, tokens, BLOCK_SIZE).attn, 0.125)
    in_place = paged_attention(q, k_cache, v_cache,
                               build_forward_batch(scheduled, tokens, BLOCK_SIZE, cpp_ops.decode_attention).attn, 0.125)
    torch.testing.assert_close(in_place, reference, rtol=1e-5, atol=1e-5)

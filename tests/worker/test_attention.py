"""The in-place C++ decode op against the plain-torch attention (the reference)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chunkserve.core.scheduler_output import ScheduledRequest
from chunkserve.worker.attention import paged_attention
from chunkserve.worker.input_batch import build_forward_batch
from chunkserve.worker import paged_ops
from chunkserve.worker.paged_ops import decode_kernel_for

BLOCK_SIZE = 16


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_in_place_decode_equals_the_torch_reference(decode_kernel, heads, kv_heads, head_dim):
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
                               build_forward_batch(scheduled, tokens, BLOCK_SIZE, decode_kernel).attn, 0.125)
    torch.testing.assert_close(in_place, reference, rtol=1e-5, atol=1e-5)


def test_backend_choice(decode_kernel):
    assert decode_kernel_for("torch") is None
    assert decode_kernel_for("auto") is decode_kernel and decode_kernel_for("cpp") is decode_kernel
    with pytest.raises(ValueError, match="attention backend must be one of"):
        decode_kernel_for("cuda")


def test_auto_falls_back_to_torch_where_the_op_cannot_build(monkeypatch, caplog):
    def failed_build():
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(paged_ops, "build_decode_kernel", failed_build)
    assert decode_kernel_for("auto") is None
    assert "could not be built (no C++ compiler); using the torch attention" in caplog.text
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        decode_kernel_for("cpp")

"""Deterministic mode's layer ops (ops/deterministic_ops.py): a row's output bits are the same
whatever the number of rows beside it and its place among them, for every linear kind and the
LM head, in float32 and bfloat16 mode; and they stay close to F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chunkserve.config.cpu import native_bf16
from chunkserve.errors import InvalidRequestError
from chunkserve.ops.cpp_ops import model_ops_for
from chunkserve.ops.deterministic_ops import (
    DETERMINISTIC_BF16_BLOCK_MAX_ROWS,
    DETERMINISTIC_BLOCK_MAX_ROWS,
)
from chunkserve.ops.model_ops import BLOCK_TYPES
from tests.ops.support import NMSE_BOUND, nmse
from tests.ops.support_determinism import (
    BATCH,
    DENSE_DEPTHS,
    assert_rows_invariant,
    layer_on,
    linear_inputs,
)

KINDS = [*DENSE_DEPTHS, *sorted(BLOCK_TYPES)]  # dense float weights, or GGUF blocks of that type


# (dtype, instruction set): bfloat16's kernel is AVX-512 only (refused on AVX2: the last test)
MODES = [(torch.float32, "avx512"), (torch.float32, "avx2"), (torch.bfloat16, "avx512")]


@pytest.fixture(params=MODES, ids=[f"{str(dtype).removeprefix('torch.')}-{isa}" for dtype, isa in MODES])
def mode(request, cpp_ops):
    """Deterministic mode's ops in each dtype, on each instruction set its kernel has, where this
    CPU runs it."""
    dtype, isa = request.param
    if dtype == torch.bfloat16 and not native_bf16():
        pytest.skip("bfloat16 mode needs a CPU with AVX512_BF16")
    try:
        before = cpp_ops.set_cpu_isa(isa)
    except RuntimeError as error:
        pytest.skip(f"not on this CPU: {error}")
    yield cpp_ops.model_ops(dtype, deterministic=True), dtype
    cpp_ops.set_cpu_isa(before)


@pytest.mark.parametrize("head", [False, True], ids=["linear", "lm_head"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(mode, kind, head):
    """Row counts 1 to 1024, across every row tile, the blocks/floats switch and the large-batch
    range, with each row first, in the middle and last of its batch."""
    ops, _ = mode
    x, weight, blocks = linear_inputs(kind, features=37 if head else 67, seed=len(kind))
    layer = layer_on(ops, weight, blocks, head)
    assert_rows_invariant(lambda rows: layer(x[rows]))


@pytest.mark.parametrize("kind", KINDS)
def test_the_deterministic_linear_stays_close_to_f_linear(mode, kind):
    ops, dtype = mode
    x, weight, blocks = linear_inputs(kind, features=67, seed=7)
    bias = torch.randn(weight.shape[0])
    got = layer_on(ops, weight, blocks, head=False, bias=bias)(x)
    if dtype == torch.float32:
        torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)
    else:  # one rounding of x and of the weight to bfloat16, exact products, float32 sums
        rounded = F.linear(x.bfloat16().double(), weight.bfloat16().double(), bias.double())
        torch.testing.assert_close(got.double(), rounded, rtol=1e-5, atol=1e-4)
        assert nmse(got, F.linear(x, weight, bias)) < NMSE_BOUND


def test_the_fused_decode_layer_serves_only_the_rows_that_read_blocks(cpp_ops):
    """It calls the block kernels, which the per-op path calls up to the blocks' row limit
    (tests/model/test_llama.py checks its bits against the per-op path)."""
    float32 = cpp_ops.model_ops(torch.float32, deterministic=True)
    assert float32.decoder_layers is cpp_ops.deterministic_decoder_layers
    assert 0 < float32.decoder_layer_max_rows <= DETERMINISTIC_BLOCK_MAX_ROWS
    if cpp_ops.bf16_dot_supported():
        bf16 = cpp_ops.model_ops(torch.bfloat16, deterministic=True)
        assert bf16.decoder_layers is cpp_ops.deterministic_bf16_decoder_layers
        assert 0 < bf16.decoder_layer_max_rows <= DETERMINISTIC_BF16_BLOCK_MAX_ROWS


def test_the_per_row_ops_give_a_row_the_same_bits_in_any_batch(cpp_ops):
    ops = cpp_ops.model_ops(torch.float32, deterministic=True)
    generator = torch.Generator().manual_seed(3)
    x, residual, gate_up = (torch.randn(BATCH, size, generator=generator) for size in (576, 576, 2 * 576))
    norm_weight = torch.randn(576, generator=generator)
    q, k, angles = (torch.randn(BATCH, *shape, generator=generator) for shape in ((9, 64), (3, 64), (32,)))
    assert_rows_invariant(lambda rows: ops.rms_norm(x[rows], norm_weight, 1e-5))
    assert_rows_invariant(lambda rows: ops.silu_and_mul(gate_up[rows]))
    assert_rows_invariant(lambda rows: torch.cat(ops.add_rms_norm(x[rows], residual[rows].clone(), norm_weight, 1e-5),
                                                 dim=1))
    assert_rows_invariant(lambda rows: torch.cat([part.reshape(part.shape[0], -1) for part in ops.rotary(
        q[rows].clone(), k[rows].clone(), angles[rows].cos(), angles[rows].sin())], dim=1))


def test_deterministic_mode_refuses_what_it_cannot_keep_invariant(cpp_ops):
    with pytest.raises(InvalidRequestError, match="--int8-activations"):
        cpp_ops.model_ops(torch.float32, int8_activations=True, deterministic=True)
    with pytest.raises(InvalidRequestError, match="--op-backend cpp"):
        model_ops_for(None, torch.float32, deterministic=True)
    before = cpp_ops.set_cpu_isa("avx2")
    try:
        with pytest.raises(InvalidRequestError, match="--dtype float32"):
            cpp_ops.model_ops(torch.bfloat16, deterministic=True)
    finally:
        cpp_ops.set_cpu_isa(before)

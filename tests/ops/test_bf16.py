"""bfloat16 mode's linear layers (`--dtype bfloat16`): their error against the float32 op, and
which rows take bfloat16 arithmetic. The error is llama.cpp's per-op measure (test-backend-ops),
the normalised squared error sum((a - b)^2) / sum(b^2) against the float32 result, under its bar
for matrix products. The bfloat16 KV cache's attention has the same contract in
tests/attention/test_paged.py."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from chunkserve.ops.cpp_ops import BF16_ONEDNN_MIN_ROWS, SMALL_BATCH_MAX_ROWS, onednn_bf16_linear, pack_for_onednn
from chunkserve.ops.model_ops import TORCH_BF16_OPS
from tests.ops.support import NMSE_BOUND, nmse, quantized


@pytest.mark.parametrize("rows", [1, BF16_ONEDNN_MIN_ROWS, 64, 300])
@pytest.mark.parametrize("features, depth", [(960, 576), (576, 1536), (3072, 576), (5, 13)])
@pytest.mark.parametrize("path", ["oneDNN", "torch"])
def test_bf16_linear_is_within_the_bound_of_float32(rows, features, depth, path):
    """SmolLM2's layer shapes and an odd one, with and without a bias, on both paths."""
    generator = torch.Generator().manual_seed(rows * features + depth)
    x = torch.randn(rows, depth, generator=generator)
    weight = torch.randn(features, depth, generator=generator)
    bias = torch.randn(features, generator=generator)
    if path == "oneDNN":
        packed = pack_for_onednn(weight, torch.bfloat16)
        assert packed is not None and packed.dtype == torch.bfloat16
        got, got_bias = onednn_bf16_linear(x, packed, None), onednn_bf16_linear(x, packed, bias)
    else:
        packed = TORCH_BF16_OPS.pack_linear_weight(weight)
        got = TORCH_BF16_OPS.linear(x, weight.to("meta"), None, None, packed)
        got_bias = TORCH_BF16_OPS.linear(x, weight.to("meta"), bias, None, packed)
    assert got.dtype == torch.float32 and got.shape == (rows, features)
    assert nmse(got, F.linear(x, weight)) < NMSE_BOUND
    assert nmse(got_bias, F.linear(x, weight, bias)) < NMSE_BOUND


def test_bf16_mode_routes_few_rows_to_the_blocks_and_the_rest_to_bf16_onednn(cpp_ops):
    """A layer with GGUF blocks, and the LM head, compute steps below BF16_ONEDNN_MIN_ROWS rows
    from the blocks (`bf16_mode_block_linear`), the larger ones by bfloat16 oneDNN; a layer
    without blocks has only its bfloat16 weight (the float32 one is dropped), so oneDNN takes
    every step."""
    routes = []
    ops = dataclasses.replace(
        cpp_ops,
        bf16_mode_block_linear=lambda x, *rest: routes.append(("blocks", x.shape[0])) or torch.zeros(x.shape[0], 16),
        onednn_bf16_linear=lambda x, packed, bias: routes.append(("bf16", x.shape[0])) or torch.zeros(x.shape[0], 16),
        small_batch_linear=lambda *args: pytest.fail("the float32 weight was read"),
    ).model_ops(torch.bfloat16)
    assert ops.packed_replaces_float and ops.decoder_layers is cpp_ops.bf16_decoder_layers
    blocks, _ = quantized(torch.randn(16, 64), "Q8_0")
    weight, packed = torch.empty(16, 64, device="meta"), torch.empty(0)  # neither is read: the recorders stand in
    for rows in (1, BF16_ONEDNN_MIN_ROWS - 1, BF16_ONEDNN_MIN_ROWS, SMALL_BATCH_MAX_ROWS + 1):
        ops.linear(torch.randn(rows, 64), weight, None, blocks, packed)
    for rows in (1, 300):
        ops.linear(torch.randn(rows, 64), weight, None, None, packed)
    for rows in (2, BF16_ONEDNN_MIN_ROWS):
        ops.logits(torch.randn(rows, 64), weight, None, blocks, packed)
    assert routes == [("blocks", 1), ("blocks", BF16_ONEDNN_MIN_ROWS - 1), ("bf16", BF16_ONEDNN_MIN_ROWS),
                      ("bf16", SMALL_BATCH_MAX_ROWS + 1), ("bf16", 1), ("bf16", 300),
                      ("blocks", 2), ("bf16", BF16_ONEDNN_MIN_ROWS)]


def bf16_rounded_product(x: torch.Tensor, floats: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x rounded to bfloat16 times the exact weights, in float64: what a kernel that rounds only x computes."""
    out = x.to(torch.bfloat16).double() @ floats.double().T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_bf16_mode_multiplies_the_blocks_in_bfloat16(cpp_ops, type_name):
    """Every decode step's block products are bfloat16, within the bound of float32: by the
    kernel on the interleaved blocks (x rounded to bfloat16, the weights exact) for every row
    count below oneDNN's; where a weight has no interleaved copy, bf16_dot_linear's bits from two
    rows and float32 arithmetic for one; with --int8-activations every row count keeps the 8-bit
    kernel."""
    if not cpp_ops.bf16_dot_supported():
        pytest.skip("bfloat16 products need AVX-512 with AVX512_BF16")
    generator = torch.Generator().manual_seed(7)
    blocks, floats = quantized(torch.randn(96, 576, generator=generator), type_name)
    bias = torch.randn(96, generator=generator)
    interleaved = cpp_ops.pack_interleaved_blocks(blocks.blocks, blocks.ggml_type)
    few_rows = functools.partial(cpp_ops.bf16_mode_block_linear, blocks=blocks.blocks, ggml_type=blocks.ggml_type,
                                 bias=bias, interleaved=interleaved)
    for rows in (1, 2, BF16_ONEDNN_MIN_ROWS - 1):
        x = torch.randn(rows, 576, generator=generator)
        got = few_rows(x)
        float32 = cpp_ops.block_quantized_linear(x, blocks.blocks, blocks.ggml_type, bias, False)
        assert torch.equal(got, cpp_ops.interleaved_bf16_linear(x, interleaved, blocks.ggml_type, bias))
        # outputs of magnitude ~20: float32 sums of the 128-offset weights (Q8_0's two halves) stay within 1e-3
        torch.testing.assert_close(got.double(), bf16_rounded_product(x, floats, bias), rtol=0, atol=1e-3)
        assert not torch.equal(got, float32)
        assert nmse(got, F.linear(x, floats, bias)) < NMSE_BOUND
        file_blocks = few_rows(x, interleaved=None)
        if rows == 1:
            assert torch.equal(file_blocks, float32)
        else:
            assert torch.equal(file_blocks, cpp_ops.bf16_dot_linear(x, blocks.blocks, blocks.ggml_type, bias))
        if cpp_ops.cpu_has_vnni():
            assert torch.equal(few_rows(x, int8_activations=True),
                               cpp_ops.block_quantized_linear(x, blocks.blocks, blocks.ggml_type, bias, True))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_interleaved_layout_keeps_every_weight_of_the_file(cpp_ops, type_name):
    """One-hot rows (exact in bfloat16) pick single weights out of the interleaved kernel's
    product: every value of a nibble or byte, at every position of a block and every feature of a
    record, must come back as gguf's `dequantize` gives it (to float32 rounding: the kernel applies
    the scale to an integer sum), one row at a time and in steps of 3, 8 and 13 (8 + 5) rows. The layout
    has as many bytes as the file's blocks."""
    if not cpp_ops.bf16_dot_supported():
        pytest.skip("the interleaved kernel needs AVX-512 with AVX512_BF16")
    generator = torch.Generator().manual_seed(11)
    blocks, floats = quantized(torch.randn(32, 64, generator=generator) * 3, type_name)
    interleaved = cpp_ops.pack_interleaved_blocks(blocks.blocks, blocks.ggml_type)
    assert interleaved.numel() == blocks.blocks.numel()
    one_hot = torch.eye(64)
    for rows in (1, 3, 8, 13):
        got = torch.cat([cpp_ops.interleaved_bf16_linear(one_hot[start:start + rows], interleaved, blocks.ggml_type,
                                                         None) for start in range(0, 64, rows)])
        torch.testing.assert_close(got, floats.T, rtol=1e-6, atol=1e-6)


def test_the_interleaved_kernel_names_what_it_cannot_take(cpp_ops):
    """A weight whose features are not whole records of 16 keeps the file's blocks (the ops
    make no interleaved copy of it); the kernel itself refuses such blocks, other block types
    and rows of another depth, naming them."""
    if not cpp_ops.bf16_dot_supported():
        pytest.skip("the interleaved kernel needs AVX-512 with AVX512_BF16")
    odd, _ = quantized(torch.randn(24, 64), "Q4_1")
    assert cpp_ops._pack_interleaved(odd) is None
    with pytest.raises(RuntimeError, match="N a multiple of 16"):
        cpp_ops.pack_interleaved_blocks(odd.blocks, odd.ggml_type)
    blocks, _ = quantized(torch.randn(32, 64), "Q4_1")
    with pytest.raises(RuntimeError, match="ggml type 12 is not Q4_0"):
        cpp_ops.pack_interleaved_blocks(blocks.blocks, 12)
    interleaved = cpp_ops._pack_interleaved(blocks)
    with pytest.raises(RuntimeError, match="x must be float32 \\[M, 64\\]"):
        cpp_ops.interleaved_bf16_linear(torch.randn(2, 32), interleaved, blocks.ggml_type, None)


def test_only_bf16_mode_without_int8_activations_interleaves_the_blocks(cpp_ops):
    """The interleaved layout is an extra copy of the blocks: made where bfloat16 mode reads it,
    by no other mode."""
    assert cpp_ops.model_ops(torch.bfloat16).pack_interleaved_blocks is not None
    assert cpp_ops.model_ops(torch.bfloat16, int8_activations=True).pack_interleaved_blocks is None
    assert cpp_ops.model_ops(torch.float32).pack_interleaved_blocks is None
    assert cpp_ops.model_ops(torch.bfloat16, deterministic=True).pack_interleaved_blocks is None

"""`--int8-activations`: the GGUF block linear with its activations quantized to 8 bits per
block of 32 (llama.cpp's Q8_0) and integer dot products (AVX-512 VNNI).

Its result is defined exactly: the product of x's Q8_0 round trip with the dequantized weights,
summed in float32 (so up to float32 rounding); against the float32 op, its error is llama.cpp's
per-op measure under its bar for matrix products. The model-level contract is in
tests/model/test_int8_accuracy.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from chunkserve.config.cpu import native_int8_dot
from chunkserve.ops.cpp_ops import LOGITS_MAX_ROWS, ONEDNN_MIN_ROWS, model_ops_for
from chunkserve.ops.model_ops import BLOCK_TYPES
from tests.ops.support import NMSE_BOUND, nmse, quantized

needs_vnni = pytest.mark.skipif(not native_int8_dot(), reason="8-bit activations need AVX-512 VNNI")


def q8_0_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x with each run of 32 values replaced by its Q8_0 quantization: scale max|x| / 127, values
    x * (127 / max|x|) rounded to the nearest integer (ties to even), as the kernel rounds."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse) * (amax / 127)).reshape(x.shape)


@needs_vnni
@pytest.mark.parametrize("type_name", sorted(BLOCK_TYPES))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 31])
@pytest.mark.parametrize("features, depth", [(960, 576), (13, 1536), (3, 64)])
def test_int8_linear_is_the_product_of_the_quantized_activations(cpp_ops, type_name, rows, features, depth):
    """Every row tile and feature tail, over each block type's layout and its offset (Q4_0's
    -8, Q8_0's sign, Q4_1's minimum): equal to the exact product of x's Q8_0 round trip up to
    float32 rounding, and within llama.cpp's error bar of the float32 op."""
    generator = torch.Generator().manual_seed(rows * features + depth)
    x = torch.randn(rows, depth, generator=generator)
    x[0, :32] = 0  # a block of zeros: scale 0, no division by it
    blocks, weight = quantized(torch.randn(features, depth, generator=generator), type_name)
    bias = torch.randn(features, generator=generator)
    got = cpp_ops.block_quantized_linear(x, blocks.blocks, blocks.ggml_type, bias, True)
    exact = F.linear(q8_0_round_trip(x).double(), weight.double(), bias.double()).float()
    torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-4)
    assert nmse(got, F.linear(x, weight, bias)) < NMSE_BOUND
    assert not torch.equal(got, cpp_ops.block_quantized_linear(x, blocks.blocks, blocks.ggml_type, bias, False))


@needs_vnni
def test_an_odd_number_of_blocks_keeps_float32_activations(cpp_ops):
    """The kernel takes blocks in pairs; a depth of an odd number of blocks is served in float32."""
    x = torch.randn(3, 96)
    blocks, _ = quantized(torch.randn(8, 96), "Q4_0")
    got = cpp_ops.block_quantized_linear(x, blocks.blocks, blocks.ggml_type, None, True)
    assert torch.equal(got, cpp_ops.block_quantized_linear(x, blocks.blocks, blocks.ggml_type, None, False))


@needs_vnni
def test_int8_activations_are_refused_without_avx512(cpp_ops):
    """Where the kernels run another instruction set (a CPU without AVX-512 VNNI), the op names
    what is missing instead of computing something else."""
    blocks, _ = quantized(torch.randn(4, 64), "Q4_1")
    before = cpp_ops.set_cpu_isa("avx2")
    try:
        with pytest.raises(RuntimeError, match="8-bit activations need AVX-512 with VNNI"):
            cpp_ops.block_quantized_linear(torch.randn(1, 64), blocks.blocks, blocks.ggml_type, None, True)
    finally:
        cpp_ops.set_cpu_isa(before)


@pytest.mark.parametrize("linear_dtype", [torch.float32, torch.bfloat16])
def test_int8_mode_quantizes_the_rows_the_block_kernel_serves(cpp_ops, linear_dtype):
    """The mode changes the numerics of the block kernel's rows (the layers' few-row steps, every
    LM head row up to LOGITS_MAX_ROWS) and of nothing else: oneDNN's larger steps and the float
    kernel's weights without blocks keep their own."""
    calls = []

    def recording_kernel(x, blocks, ggml_type, bias, int8_activations, interleaved=None):
        calls.append((x.shape[0], int8_activations))
        return torch.zeros(x.shape[0], 16)

    ops = model_ops_for(dataclasses.replace(cpp_ops, block_quantized_linear=recording_kernel,
                                            bf16_mode_block_linear=recording_kernel), linear_dtype, True)
    assert ops.int8_activations
    blocks, weight = quantized(torch.randn(16, 64), "Q8_0")
    packed = ops.pack_linear_weight(weight)
    for rows in (1, 8):
        ops.linear(torch.randn(rows, 64), weight, None, blocks, packed)
    ops.linear(torch.randn(ONEDNN_MIN_ROWS, 64), weight, None, blocks, packed)  # oneDNN's in both dtypes
    ops.logits(torch.randn(LOGITS_MAX_ROWS, 64), weight, None, blocks)
    assert calls == [(1, True), (8, True), (LOGITS_MAX_ROWS, True)]
    no_blocks = ops.linear(torch.randn(2, 64), weight, None, None, None if linear_dtype == torch.float32 else packed)
    assert no_blocks.shape == (2, 16) and len(calls) == 3


def test_int8_mode_needs_the_cpp_ops():
    with pytest.raises(Exception, match="--int8-activations runs in the C\\+\\+ ops"):
        model_ops_for(None, torch.float32, True)

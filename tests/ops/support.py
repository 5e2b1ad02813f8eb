"""Helpers of the op tests: GGUF blocks of a weight, and the error measure of the non-float32
modes' per-op contracts."""

from __future__ import annotations

import gguf
import torch

from chunkserve.ops.model_ops import BlockWeight

# llama.cpp's bar for a matrix product's normalised squared error against the reference backend
# (ggml tests/test-backend-ops.cpp, mul_mat's max_nmse_err); bfloat16 mode's ops meet it.
NMSE_BOUND = 5e-4


def nmse(got: torch.Tensor, expected: torch.Tensor) -> float:
    """sum((got - expected)^2) / sum(expected^2), in float64."""
    got, expected = got.double(), expected.double()
    return float(((got - expected) ** 2).sum() / (expected**2).sum())


def quantized(weight: torch.Tensor, type_name: str) -> tuple[BlockWeight, torch.Tensor]:
    """`weight` as GGUF blocks, and the floats those blocks stand for."""
    ggml_type = gguf.GGMLQuantizationType[type_name]
    blocks = gguf.quants.quantize(weight.numpy(), ggml_type)
    floats = torch.from_numpy(gguf.quants.dequantize(blocks, ggml_type))
    return BlockWeight(int(ggml_type), torch.from_numpy(blocks)), floats

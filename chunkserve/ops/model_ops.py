"""The model's elementwise and linear ops, behind one swappable set.

The layers call `ModelOps` instead of torch directly so that the worker can hand them fused
C++ versions (ops/cpp_ops.py). At decode batch sizes a layer is some 60 small torch calls
whose dispatch costs more than their arithmetic; fused, it is about 15. `TORCH_OPS` is the
plain-torch set: the reference the C++ ops are tested against, and what runs where they do
not build.

A linear layer loaded from a block-quantized GGUF tensor also carries its `BlockWeight`; ops
that can compute from the blocks may, ops that cannot use the float weight, which is the
blocks' exact dequantization. A layer may also carry its weight in a layout the ops prefer
(`pack_linear_weight`, made once when the ops are set).

In bfloat16 mode (`--dtype bfloat16`, `linear_dtype`) the packed weight is bfloat16 and the
linear layers' products run in bfloat16 (float32 accumulation) where they read it; everything
else (the residual stream, norms, rotary, the LM head) stays float32.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

# GGML block types whose 32-weight blocks the C++ linear reads directly (gguf.GGMLQuantizationType names).
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0")


@dataclass(frozen=True)
class BlockWeight:
    """A weight matrix as a GGUF file stores it: each row a run of 32-weight blocks of
    `ggml_type` (one of BLOCK_TYPES). A decode step reads every weight once, and these bytes
    are 3.8x (Q8_0) to 7x (Q4_0) fewer than float32's."""

    ggml_type: int
    blocks: Tensor  # uint8 [out_features, in_features // 32 * bytes per block]
    # the same bytes interleaved for the ops' decode kernel (`ModelOps.pack_interleaved_blocks`), or None
    interleaved: Tensor | None = None

    @staticmethod
    def stack(parts: list[BlockWeight | None]) -> BlockWeight | None:
        """The blocks of a fused weight (its parts' rows one after another), or None unless
        every part has blocks of one type."""
        types = {None if part is None else part.ggml_type for part in parts}
        if len(types) != 1 or None in types:
            return None
        return BlockWeight(types.pop(), torch.cat([part.blocks for part in parts]))


@dataclass(frozen=True)
class ModelOps:
    # (x, weight, bias, blocks, packed) -> F.linear(x, weight, bias); `blocks` the same weight as GGUF
    # blocks, or None; `packed` the same weight as `pack_linear_weight` made it, or None
    linear: Callable[[Tensor, Tensor, Tensor | None, BlockWeight | None, Tensor | None], Tensor]
    # the LM head's (vocab-sized), with the `linear` arguments; `packed` is what `pack_logits_weight` made, or None
    logits: Callable[[Tensor, Tensor, Tensor | None, BlockWeight | None, Tensor | None], Tensor]
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]  # (x, weight, eps), over the last dim
    # (x, residual, weight, eps) -> (rms_norm(x + residual), x + residual); may update residual in place
    add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    # (q [T, H, D], k [T, KH, D], cos [T, D/2], sin [T, D/2]) -> rotated (q, k), neox layout; may rotate in place
    rotary: Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
    silu_and_mul: Callable[[Tensor], Tensor]  # [T, 2I] -> silu(first half) * second half
    # weight [out, in] -> the same weight in the layout `linear` reads fastest, or None (keep the float weight)
    pack_linear_weight: Callable[[Tensor], Tensor | None]
    # decoder layers of a pure decode step of at most `decoder_layer_max_rows` rows in one call, with the
    # arguments of csrc/ops.h `decoder_layers`; the same result as the layers' modules through the other ops
    decoder_layers: Callable[..., tuple[Tensor, Tensor]] | None = None
    decoder_layer_max_rows: int = 0
    # the LM head's weight [vocab, hidden] -> the layout `logits` reads for larger batches; None: the head reads its
    # float32 weight or blocks only
    pack_logits_weight: Callable[[Tensor], Tensor | None] | None = None
    # `--int8-activations`: `linear` and `logits` quantize the activations they multiply with GGUF blocks to 8
    # bits; `decoder_layers` takes this as its last argument
    int8_activations: bool = False
    # True: `linear` reads a layer's packed weight for every row count, never its float weight
    # (False: only where the layer also has blocks, which serve the rows the packed weight does not)
    packed_replaces_float: bool = False
    # GGUF blocks -> their `BlockWeight.interleaved` copy, which `linear`, `logits` and `decoder_layers` read
    # for decode-sized steps, or None (that weight keeps the blocks' kernels); None: no such kernel
    pack_interleaved_blocks: Callable[[BlockWeight], Tensor | None] | None = None


def _linear(x: Tensor, weight: Tensor, bias: Tensor | None, blocks: BlockWeight | None = None,
            packed: Tensor | None = None) -> Tensor:
    return F.linear(x, weight, bias)


def _no_packing(weight: Tensor) -> None:
    return None


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    residual = x + residual
    return _rms_norm(residual, weight, eps), residual


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _silu_and_mul(x: Tensor) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _bf16_linear(x: Tensor, weight: Tensor, bias: Tensor | None, blocks: BlockWeight | None = None,
                 packed: Tensor | None = None) -> Tensor:
    """F.linear in bfloat16 on the layer's bfloat16 weight (`packed`), float32 in and out."""
    if packed is None:
        return F.linear(x, weight, bias)
    out = F.linear(x.to(packed.dtype), packed).float()
    return out if bias is None else out + bias


def _to_bf16(weight: Tensor) -> Tensor:
    return weight.to(torch.bfloat16)


TORCH_OPS = ModelOps(linear=_linear, logits=_linear, rms_norm=_rms_norm, add_rms_norm=_add_rms_norm, rotary=_rotary,
                     silu_and_mul=_silu_and_mul, pack_linear_weight=_no_packing)
# bfloat16 mode in plain torch: every row count of every linear layer in bfloat16
TORCH_BF16_OPS = dataclasses.replace(TORCH_OPS, linear=_bf16_linear, pack_linear_weight=_to_bf16,
                                     packed_replaces_float=True)


def torch_ops(linear_dtype: torch.dtype) -> ModelOps:
    """The plain-torch set for float32 or bfloat16 linear layers."""
    return TORCH_BF16_OPS if linear_dtype == torch.bfloat16 else TORCH_OPS

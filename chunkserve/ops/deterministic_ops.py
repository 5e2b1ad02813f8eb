"""The layer ops of deterministic mode (`--deterministic`): a row's bits whatever its batch.

The default ops pick a linear kernel by the step's row count (cpp_ops.py: the C++ kernel on a
few rows, oneDNN or MKL on many), and each kernel sums an output's K products in its own
order, so a request's logits change with what else is in its step. Here every linear and the
LM head, at every row count, sums each output element in one order (csrc/deterministic_linear.cpp):

- float32: a GGUF layer reads its blocks up to `DETERMINISTIC_BLOCK_MAX_ROWS` rows (the fewest
  bytes, as in decode) and its dequantized floats above (`dequantized_linear`, no expansion per
  row tile), the two with one order and so the same bits; a layer without blocks takes
  `dequantized_linear` for every row count (the C++ small-batch kernel where K is no multiple
  of 32: one order per element too).
- bfloat16: x and the weight rounded to bfloat16 once, float32 accumulation, for every row count
  (`bf16_dot_linear`); a GGUF layer reads its blocks (rounded in registers) up to
  `DETERMINISTIC_BF16_BLOCK_MAX_ROWS` rows and its packed bfloat16 weight above, the same bits.

Norms, rotary and SiLU are per row in the C++ ops already and are shared with the default set.
The fused decode layers call the kernels above (`deterministic_decoder_layers` in float32 mode,
`deterministic_bf16_decoder_layers` in bfloat16 mode), so they serve the pure decode steps of the rows that read
blocks, with the per-op path's bits; a layer without blocks is not fused in bfloat16 mode
(`LlamaModel.set_ops` drops its float weight).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from chunkserve.errors import InvalidRequestError
from chunkserve.ops.model_ops import BlockWeight, ModelOps

if TYPE_CHECKING:
    from chunkserve.ops.cpp_ops import CppOps

# Up to this many rows a GGUF layer's float32 products read its blocks, above its dequantized
# floats: the same bits either way, the faster of the two each side on SmolLM2-135M's layer
# shapes with 30 layers' weights streaming from memory (the blocks are fewer bytes; the floats
# need no expansion per row tile).
DETERMINISTIC_BLOCK_MAX_ROWS = 64
# The same in bfloat16 mode, between the blocks and the packed bfloat16 weight.
DETERMINISTIC_BF16_BLOCK_MAX_ROWS = 12


def deterministic_model_ops(cpp_ops: CppOps, linear_dtype: torch.dtype, int8_activations: bool) -> ModelOps:
    """`cpp_ops`' layer ops with one reduction order per output element for every row count,
    in float32 or bfloat16 (`linear_dtype`); raises where the mode cannot run as asked."""
    if int8_activations:
        raise InvalidRequestError("--deterministic does not combine with --int8-activations (8-bit activations "
                                  "take another kernel): leave one of them off", param="int8_activations")
    bf16 = linear_dtype == torch.bfloat16
    if bf16 and not cpp_ops.bf16_dot_supported():
        raise InvalidRequestError("--deterministic in bfloat16 mode needs AVX-512 with AVX512_BF16, which this CPU "
                                  "lacks: use --dtype float32 with it", param="deterministic")
    if bf16:
        linear = functools.partial(_bf16_linear, cpp_ops)
        pack = cpp_ops.round_to_bf16
    else:
        linear = functools.partial(_float32_linear, cpp_ops)
        pack = _float_twin
    return ModelOps(linear=linear, logits=linear, rms_norm=cpp_ops.rms_norm, add_rms_norm=cpp_ops.add_rms_norm,
                    rotary=cpp_ops.rotary_embedding, silu_and_mul=cpp_ops.silu_and_mul, pack_linear_weight=pack,
                    packed_replaces_float=bf16, pack_logits_weight=pack if bf16 else None,
                    decoder_layers=cpp_ops.deterministic_bf16_decoder_layers if bf16 else cpp_ops.deterministic_decoder_layers,
                    decoder_layer_max_rows=DETERMINISTIC_BF16_BLOCK_MAX_ROWS if bf16 else DETERMINISTIC_BLOCK_MAX_ROWS)


def _float_twin(weight: torch.Tensor) -> torch.Tensor | None:
    """The float32 weight that `dequantized_linear` reads, None where its K does not suit it (for
    a GGUF layer the blocks' exact dequantization, which the model holds already: no copy)."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % 32:
        return None
    return weight.detach().contiguous()  # a plain tensor on the same storage, not a second Parameter


def _float32_linear(cpp_ops: CppOps, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    blocks: BlockWeight | None = None, packed: torch.Tensor | None = None) -> torch.Tensor:
    if blocks is None:  # as deterministic_decoder_layers: `packed` exists where K allows the float kernel
        return cpp_ops.small_batch_linear(x, weight, bias) if packed is None else cpp_ops.dequantized_linear(
            x, packed, bias)
    if x.shape[0] <= DETERMINISTIC_BLOCK_MAX_ROWS:
        return cpp_ops.block_quantized_linear(x, blocks.blocks, blocks.ggml_type, bias, False)
    return cpp_ops.dequantized_linear(x, weight if packed is None else packed, bias)


def _bf16_linear(cpp_ops: CppOps, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 blocks: BlockWeight | None = None, packed: torch.Tensor | None = None) -> torch.Tensor:
    if blocks is not None and x.shape[0] <= DETERMINISTIC_BF16_BLOCK_MAX_ROWS:
        return cpp_ops.bf16_dot_linear(x, blocks.blocks, blocks.ggml_type, bias)
    return cpp_ops.bf16_dot_linear(x, packed, -1, bias)  # every weight is packed in this mode, the head's too

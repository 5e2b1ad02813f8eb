"""Helpers of the deterministic-mode op tests: a layer as `LlamaModel.set_ops` leaves it, and
the check that a row's bits do not depend on the rows computed beside it."""

from __future__ import annotations

from collections.abc import Callable

import torch

from chunkserve.ops.model_ops import ModelOps
from tests.ops.support import quantized

# The row counts: every row tile, both sides of the tile sizes, and the prefill range.
ROW_COUNTS = [*range(1, 18), 31, 32, 33, 64, 127, 512, 1024]
BATCH = ROW_COUNTS[-1]


def assert_rows_invariant(run: Callable[[slice], torch.Tensor]) -> None:
    """`run(rows)` computes an op on those rows of its inputs only; each row's output must be
    the same bits in every batch: of each of ROW_COUNTS rows, placed first, middle and last."""
    full = run(slice(0, BATCH))
    for rows in ROW_COUNTS:
        for start in sorted({0, (BATCH - rows) // 2, BATCH - rows}):
            got = run(slice(start, start + rows))
            assert torch.equal(got, full[start : start + rows]), f"rows {start}-{start + rows - 1} as a batch of {rows}"


# A dense float32 weight whose K suits the AVX-512 float kernel, and one whose K does not.
DENSE_DEPTHS = {"float32": 576, "float32-K200": 200}


def linear_inputs(kind: str, features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, object]:
    """x [BATCH, K], a weight [features, K] and its GGUF blocks of type `kind` (None for the dense
    kinds of DENSE_DEPTHS; the blocks' K the MLP down projection's, which the float32 kernel
    takes in two runs)."""
    generator = torch.Generator().manual_seed(seed)
    depth = DENSE_DEPTHS.get(kind, 1536)
    x = torch.randn(BATCH, depth, generator=generator)
    weight = torch.randn(features, depth, generator=generator)
    if kind in DENSE_DEPTHS:
        return x, weight, None
    blocks, floats = quantized(weight, kind)
    return x, floats, blocks


def layer_on(ops: ModelOps, weight: torch.Tensor, blocks, head: bool,
             bias: torch.Tensor | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> the linear (or, `head`, the LM head) through `ops` on the weights as the model keeps
    them once `set_ops` packed them: a layer's float weight dropped where the ops say so."""
    pack = ops.pack_logits_weight if head else ops.pack_linear_weight
    packed = None if pack is None else pack(weight)
    if not head and packed is not None and (blocks is not None or ops.packed_replaces_float):
        weight = weight.to("meta")  # read by nothing, as the model's
    run = ops.logits if head else ops.linear
    return lambda x: run(x, weight, bias, blocks, packed)

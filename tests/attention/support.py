"""Helpers of the attention tests: one request's queries, keys and values in a paged cache, and
the check that deterministic mode gives each of its query rows one set of bits."""

from __future__ import annotations

import numpy as np
import torch

from chunkserve.core.messages import ScheduledRequest

SCALE = 0.125
SMOLLM2 = (9, 3, 64)  # heads, kv heads, head_dim
# GQA groups of 3 (a decode: the three-row AVX-512 kernel), 4 and 5 (six-row micro-tiles and
# their tails), 1 and 2; heads with and without AVX-512's 64-column value tiles
SHAPES = [SMOLLM2, (8, 2, 128), (10, 2, 64), (4, 4, 32), (6, 3, 40)]
LENGTH = 200  # positions of the sequence under test: key tiles 0, 64, 128 and a partial one
POSITIONS = [0, 5, 63, 64, 65, 127, 130, 199]  # tile edges, micro-tile places 0..5 across GQA rows
CHUNKS = [(0, LENGTH), (0, 1), (0, 66), (3, 7), (60, 8), (64, 64), (100, 100), (127, 4), (129, 2), (199, 1),
          (1, 199), (50, 130)]  # (start, rows)


class Sequence:
    """One request's queries at every position, and its keys and values in a paged cache whose
    other slots hold other requests' keys."""

    def __init__(self, kv_dtype: torch.dtype, block_size: int, shape: tuple[int, int, int] = SMOLLM2) -> None:
        heads, kv_heads, head_dim = shape
        generator = torch.Generator().manual_seed(42)
        num_blocks = 2 * -(-LENGTH // block_size) + 4
        self.k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=generator).to(kv_dtype)
        self.v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, generator=generator).to(kv_dtype)
        self.q = torch.randn(LENGTH, heads, head_dim, generator=generator)
        self.blocks = [int(b) for b in np.random.default_rng(7).permutation(num_blocks)]
        self.table = self.blocks[: -(-LENGTH // block_size)]
        self.block_size = block_size

    def decodes(self, kernels, positions: list[int]) -> torch.Tensor:
        """Decode rows at `positions`, all in one call of the decode op."""
        tables = torch.tensor([self.table] * len(positions))
        return kernels.decode(self.q[positions], self.k_cache, self.v_cache, tables,
                              torch.tensor([p + 1 for p in positions]), self.block_size, SCALE)

    def chunk(self, kernels, start: int, rows: int) -> torch.Tensor:
        return kernels.prefill(self.q[start: start + rows], self.k_cache, self.v_cache, torch.tensor(self.table),
                               start, self.block_size, SCALE)


def assert_same_bits_on_every_path(kernels, sequence: Sequence) -> None:
    """Each of POSITIONS: decoding alone, beside other decodes, and at its row of each of CHUNKS."""
    alone = {p: sequence.decodes(kernels, [p])[0] for p in POSITIONS}
    crowd = [7, 199, 0, 64, 130, 5, 150, 63, 127, 65, 33]  # 11 decodes of 1 to 200 keys, each once
    for p, row in zip(crowd, sequence.decodes(kernels, crowd)):
        if p in alone:
            assert torch.equal(row, alone[p]), f"decode at {p} beside others"
    for start, rows in CHUNKS:
        out = sequence.chunk(kernels, start, rows)
        for p in POSITIONS:
            if start <= p < start + rows:
                assert torch.equal(out[p - start], alone[p]), f"row {p - start} of chunk ({start}, {rows})"


def key_slots(sequence: Sequence) -> torch.Tensor:
    """The cache slots of the sequence's positions 0 .. LENGTH - 1."""
    positions = torch.arange(LENGTH)
    return torch.tensor(sequence.table)[positions // sequence.block_size] * sequence.block_size \
        + positions % sequence.block_size


def request_on(request_id: str, start: int, count: int, sequence: Sequence) -> ScheduledRequest:
    """A request reading the sequence's blocks (as a prefix-cache hit shares them)."""
    return ScheduledRequest(request_id, start, count, sequence.table, True, True, count == 1)

"""A prompt's images as the engine core sees them: placeholder ranges with a content hash.

The frontend expands each image into placeholder tokens (the model's processor decides how
many) and describes it as a `MultiModalFeature`: where its range sits in the prompt, which
positions of the range take encoder output rows (`is_embed`; Idefics3 puts row/column marker
tokens between the image tokens of one image), the processor's tensors for it (plain numpy),
and `identifier`, a hash of that content. The scheduler treats a feature as an atomic encoder
input (the vision encoder sees the whole image at once) whose output rows a prompt chunk may
take a slice of; the identifier names the encoder output in the encoder cache and keys the
prefix cache, so the same image is encoded once and a different image never reuses another's KV.

Plain data (numpy arrays at most), no torch: it crosses the process boundary with the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(eq=False)
class MultiModalFeature:
    identifier: str  # hex SHA-256 of the item's preprocessed content: the encoder cache's and prefix cache's key
    offset: int  # prompt position of the first token of its placeholder range
    length: int  # positions in the range
    data: dict[str, np.ndarray] = field(default_factory=dict)  # the processor's tensors for this item alone
    is_embed: np.ndarray | None = None  # bool [length]: positions that take encoder rows (None: all of them)
    modality: str = "image"

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 1:
            raise ValueError(f"a placeholder range needs offset >= 0 and length >= 1, got {self.offset}, {self.length}")
        if self.is_embed is not None and self.is_embed.shape != (self.length,):
            raise ValueError(f"is_embed must have one entry per position of the range ({self.length}), "
                             f"got shape {self.is_embed.shape}")

    @property
    def end(self) -> int:
        """The first prompt position after the range."""
        return self.offset + self.length

    @property
    def num_embeds(self) -> int:
        """Encoder output rows the item has (and the encoder cache holds for it)."""
        return self.length if self.is_embed is None else int(self.is_embed.sum())

    def overlaps(self, start: int, end: int) -> bool:
        """Whether prompt positions [start, end) include any of the range."""
        return start < self.end and self.offset < end

    def embed_rows(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """For prompt positions [start, end): (the positions that take encoder rows, relative to
        `start`; the encoder output rows they take), in order. A chunk cut through the range
        takes exactly its own slice: offset 10, length 4, all embeds, positions [12, 20) ->
        ([0, 1], [2, 3])."""
        first, last = max(start, self.offset), min(end, self.end)
        if first >= last:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty
        positions = np.arange(first, last, dtype=np.int64)
        if self.is_embed is None:
            return positions - start, positions - self.offset
        mask = self.is_embed[first - self.offset : last - self.offset]
        rows_before = int(self.is_embed[: first - self.offset].sum())
        return positions[mask] - start, rows_before + np.arange(int(mask.sum()), dtype=np.int64)

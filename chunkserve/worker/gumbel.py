"""Deterministic mode's sampling: Gumbel-max over noise hashed from (seed, position, token id),
SGLang's `multinomial_with_seed`. A draw then needs no generator state: it is a function of the
request's seed, the position of the token in its sequence and the row's distribution, so it
is the same whatever shares the batch, after a preemption, in a speculative verification or
in another process. The hash is MurmurHash3's 32-bit mix of the seed's two halves, the
position and the token id; the noise is computed in float64, where -log(-log(u)) keeps the
tails that tokens of small probability need."""

from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np
import torch

_MASK = np.uint64(0xFFFFFFFF)
_C1, _C2 = np.uint64(0xCC9E2D51), np.uint64(0x1B873593)
_FMIX1, _FMIX2 = np.uint64(0x85EBCA6B), np.uint64(0xC2B2AE35)
_HASHED_BYTES = np.uint64(16)  # four 32-bit words: MurmurHash3's length term
_UINT32_MAX = float(2**32 - 1)
_LOG_CAP = -(2.0**-32)  # log(u) at most this: u = 1 would give infinite noise


def request_seed(engine_seed: int, request_id: str) -> int:
    """The seed of a request that gives none: a stable hash of the engine's --seed and the
    request id (Python's hash() of a string changes from one process to the next)."""
    digest = hashlib.blake2b(f"{engine_seed}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def gumbel_argmax(probs: torch.Tensor, seed: int, position: int) -> int:
    """The token drawn from `probs` (float64 [vocab], any positive total) for the token at
    `position` of a request seeded `seed`: argmax of log p + g, g Gumbel noise of the hash."""
    seed %= 2**64
    prefix = np.array([0], dtype=np.uint64)
    for word in (seed & 0xFFFFFFFF, seed >> 32, position & 0xFFFFFFFF):
        prefix = _mix(prefix, _scramble(np.array([word], dtype=np.uint64)))
    hashed = _finalize(_mix(prefix, _scrambled_token_ids(probs.shape[-1])) ^ _HASHED_BYTES)
    with np.errstate(divide="ignore"):
        noise = -np.log(-np.clip(np.log(hashed / _UINT32_MAX), np.finfo(np.float64).min, _LOG_CAP))
        scores = np.log(probs.numpy()) + noise
    return int(np.argmax(scores))


@lru_cache(maxsize=4)
def _scrambled_token_ids(vocab_size: int) -> np.ndarray:
    """The token ids' half of the last mixing step, the same for every row: computed once."""
    return _scramble(np.arange(vocab_size, dtype=np.uint64))


def _rotl(x: np.ndarray, bits: int) -> np.ndarray:
    return ((x << np.uint64(bits)) | (x >> np.uint64(32 - bits))) & _MASK


def _scramble(word: np.ndarray) -> np.ndarray:
    """MurmurHash3's scrambling of a 32-bit word before it is mixed in."""
    return _rotl((word * _C1) & _MASK, 15) * _C2 & _MASK


def _mix(h: np.ndarray, scrambled: np.ndarray) -> np.ndarray:
    """MurmurHash3's step for one 32-bit word, once the word is scrambled."""
    return (_rotl(h ^ scrambled, 13) * np.uint64(5) + np.uint64(0xE6546B64)) & _MASK


def _finalize(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint64(16))
    h = (h * _FMIX1) & _MASK
    h = h ^ (h >> np.uint64(13))
    h = (h * _FMIX2) & _MASK
    return h ^ (h >> np.uint64(16))

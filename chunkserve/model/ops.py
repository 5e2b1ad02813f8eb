"""The model's elementwise and linear ops, behind one swappable set.

The layers call `ModelOps` instead of torch directly so that the worker can hand them fused
C++ versions (worker/cpp_ops.py). At decode batch sizes a layer is some 60 small torch calls
whose dispatch costs more than their arithmetic; fused, it is about 15. `TORCH_OPS` is the
plain-torch set: the reference the C++ ops are tested against, and what runs where they do
not build.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


@dataclass(frozen=True)
class ModelOps:
    linear: Callable[[Tensor, Tensor, Tensor | None], Tensor]  # as F.linear
    logits: Callable[[Tensor, Tensor, Tensor | None], Tensor]  # the LM head's F.linear (a vocab-sized output)
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]  # (x, weight, eps), over the last dim
    # (x, residual, weight, eps) -> (rms_norm(x + residual), x + residual); may update residual in place
    add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    # (q [T, H, D], k [T, KH, D], cos [T, D/2], sin [T, D/2]) -> rotated (q, k), neox layout; may rotate in place
    rotary: Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
    silu_and_mul: Callable[[Tensor], Tensor]  # [T, 2I] -> silu(first half) * second half


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


TORCH_OPS = ModelOps(linear=F.linear, logits=F.linear, rms_norm=_rms_norm, add_rms_norm=_add_rms_norm, rotary=_rotary,
                     silu_and_mul=_silu_and_mul)

"""Whether this CPU computes in bfloat16 natively, which `--dtype bfloat16` needs.

With AVX512_BF16 (dot products of bfloat16 pairs) or AMX (bfloat16 tiles), oneDNN's bfloat16
matrix products run at about twice float32's rate (docs/benchmarks-log.md); without either,
torch emulates them, some 100x slower than float32. So bfloat16 is refused there rather than
served slowly (`require_native_bf16`), and a `--dtype auto` can pick it where `native_bf16()`.
"""

from __future__ import annotations

import functools

import torch

from chunkserve.errors import InvalidRequestError

# torch.cpu.get_capabilities() names of the instructions oneDNN runs bfloat16 products on
BF16_FEATURES = {"avx512_bf16": "AVX512_BF16", "amx_bf16": "AMX"}


@functools.cache
def native_bf16() -> bool:
    """True where the CPU has AVX512_BF16 or AMX."""
    capabilities = torch.cpu.get_capabilities()
    return any(capabilities.get(name, False) for name in BF16_FEATURES)


def require_native_bf16() -> None:
    """Raise, naming what the CPU lacks and the way out, unless `native_bf16()`."""
    if native_bf16():
        return
    raise InvalidRequestError(
        f"--dtype bfloat16 needs a CPU with native bfloat16 arithmetic ({' or '.join(BF16_FEATURES.values())}); "
        f"this one has neither (torch's CPU capability: {torch.backends.cpu.get_cpu_capability()}), so bfloat16 "
        "matrix products would run about 100x slower than float32 here: use --dtype float32", param="dtype")

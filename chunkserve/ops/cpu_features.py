"""The refusals of modes on a CPU that lacks their instructions: bfloat16 mode without native
bfloat16, 8-bit activations without VNNI.

With AVX512_BF16 (dot products of bfloat16 pairs) or AMX (bfloat16 tiles), oneDNN's bfloat16
matrix products run at about twice float32's rate (docs/benchmarks-log.md); without either,
torch emulates them, far slower than float32 (docs/benchmarks-log.md, "The machine, and what
its CPU offers"). So bfloat16 is refused there rather than
served slowly; `--dtype auto` picks it only where the CPU has it (config/cpu.py, the one check).
"""

from __future__ import annotations

import torch

from chunkserve.config.cpu import BF16_FLAGS, VNNI_FLAG, native_bf16, native_int8_dot
from chunkserve.errors import InvalidRequestError


def require_native_bf16() -> None:
    """Raise, naming what the CPU lacks and the way out, unless `native_bf16()`."""
    if native_bf16():
        return
    raise InvalidRequestError(
        f"--dtype bfloat16 needs a CPU with native bfloat16 arithmetic ({' or '.join(BF16_FLAGS.values())}); "
        f"this one has neither (torch's CPU capability: {torch.backends.cpu.get_cpu_capability()}), so bfloat16 "
        "matrix products would run about 100x slower than float32 here: use --dtype float32", param="dtype")


def require_int8_dot() -> None:
    """Raise, naming what the CPU lacks, unless it has the VNNI dot products `--int8-activations` uses."""
    if native_int8_dot():
        return
    raise InvalidRequestError(
        f"--int8-activations needs a CPU with AVX-512 VNNI ({VNNI_FLAG}); this one has none: leave the flag off "
        "(the GGUF blocks are then multiplied in float32)", param="int8_activations")

"""What this CPU computes natively, where a setting's default depends on it (`--dtype auto`).

Read from the kernel's CPU flags rather than from torch, so that configuration stays free of
torch: Linux lists a feature there only when the OS has enabled it too (AVX-512 state saved
across context switches, AMX tiles permitted).
"""

from __future__ import annotations

import functools

# bfloat16 tile products (AMX), which torch's own attention kernel uses for bfloat16 operands
AMX_BF16_FLAG = "amx_bf16"
# /proc/cpuinfo flags of the instructions oneDNN computes bfloat16 products with, and their names
BF16_FLAGS = {"avx512_bf16": "AVX512_BF16", AMX_BF16_FLAG: "AMX"}
# the integer dot products (of unsigned and signed bytes) `--int8-activations` computes with
VNNI_FLAG = "avx512_vnni"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo is not there: not Linux)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_bf16() -> bool:
    """True where the CPU has AVX512_BF16 or AMX: bfloat16 matrix products there run faster than
    float32's; elsewhere torch emulates them, far slower than float32 (measured:
    docs/benchmarks-log.md, "The machine, and what its CPU offers")."""
    return bool(cpu_flags() & BF16_FLAGS.keys())


def native_int8_dot() -> bool:
    """True where the CPU has AVX-512 VNNI, which `--int8-activations`' kernel needs."""
    return VNNI_FLAG in cpu_flags()


def native_amx_bf16() -> bool:
    """True where the CPU has AMX's bfloat16 tiles: torch's flash attention multiplies bfloat16
    there at twice our AVX-512 prefill op's rate (docs/benchmarks-log.md, "Prefill attention on
    AMX tiles")."""
    return AMX_BF16_FLAG in cpu_flags()


def auto_dtype() -> str:
    """`--dtype auto`, as vLLM's CPU build: bfloat16 where the CPU computes it natively, else float32."""
    return "bfloat16" if native_bf16() else "float32"

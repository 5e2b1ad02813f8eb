"""Matrix-multiply throughput by dtype on this machine: float32 against bfloat16 and float16.

Whether a lower-precision path could pay here depends on the CPU: without native support,
torch's bf16 matmul is far slower than fp32 (issue 5 was written on such a host); with
AVX512_BF16 or AMX, oneDNN runs it faster. Times `torch.mm` on 2048 x 2048 matrices and
`F.linear` on SmolLM2-135M's layer shapes at 256 rows (a prefill chunk), best of `--repeats`,
and prints the CPU capability torch detected.

    .venv/bin/python -m benchmarks.kernels.gemm_dtypes [--repeats 5] [--smoke]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from benchmarks.support import add_smoke_flag, timed  # benchmarks/support.py

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHAPES = {"2048^3 mm": (2048, 2048, 2048), "gate_up 256 rows": (256, 3072, 576), "down 256 rows": (256, 576, 1536)}
SMOKE_SHAPES = {"64^3 mm": (64, 64, 64), "gate_up 4 rows": (4, 3072, 576)}


def gflop_s(rows: int, out_features: int, in_features: int, dtype: torch.dtype, repeats: int) -> float:
    x = torch.randn(rows, in_features).to(dtype)
    weight = torch.randn(out_features, in_features).to(dtype)
    F.linear(x, weight)  # first call: oneDNN builds its primitive
    best = min(timed(lambda: F.linear(x, weight)) for _ in range(repeats))
    return 2 * rows * out_features * in_features / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=5)
    add_smoke_flag(parser)
    args = parser.parse_args()
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    repeats = 1 if args.smoke else args.repeats
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{torch.get_num_threads()} threads")
    print("| shape | " + " | ".join(f"{str(d).removeprefix('torch.')} GFLOP/s" for d in DTYPES) + " |")
    print("|---" * (len(DTYPES) + 1) + "|")
    for name, shape in shapes.items():
        rates = [gflop_s(*shape, dtype, repeats) for dtype in DTYPES]
        print(f"| {name} | " + " | ".join(f"{rate:.0f}" for rate in rates) + " |")


if __name__ == "__main__":
    main()

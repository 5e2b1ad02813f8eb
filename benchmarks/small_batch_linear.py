"""The C++ small-batch linear (csrc/small_batch_linear.cpp) against MKL's GEMM (F.linear).

For SmolLM2-135M's layer shapes (fused qkv, o, fused gate/up, down: one weight per layer, 30
layers, so the weights come from memory as in a real step; the LM head once) and a range of
row counts: the time of all of them, per shape. This is how `SMALL_BATCH_MAX_ROWS` in
chunkserve/worker/cpp_ops.py was chosen. Weights are random: only shapes matter here.

    .venv/bin/python benchmarks/small_batch_linear.py [--rows 1 8 16 32 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from chunkserve.worker.cpp_ops import build_cpp_ops

LAYERS = 30
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def median_ms(run: Callable[[], object], repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 48, 64])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    kernel = build_cpp_ops().small_batch_linear
    weights = {name: [torch.randn(shape) for _ in range(1 if name == "lm_head" else LAYERS)]
               for name, shape in SHAPES.items()}
    print(f"{'rows':>5}{'MKL ms':>9}{'C++ ms':>9}{'speed-up':>10}   per shape, MKL / C++ ms")
    for rows in args.rows:
        mkl_total = cpp_total = 0.0
        per_shape = []
        for name, shape in SHAPES.items():
            x = torch.randn(rows, shape[1])
            mkl = median_ms(lambda: [F.linear(x, w) for w in weights[name]], args.repeats)
            cpp = median_ms(lambda: [kernel(x, w, None) for w in weights[name]], args.repeats)
            mkl_total, cpp_total = mkl_total + mkl, cpp_total + cpp
            per_shape.append(f"{name} {mkl:.1f}/{cpp:.1f}")
        print(f"{rows:>5}{mkl_total:>9.1f}{cpp_total:>9.1f}{mkl_total / cpp_total:>9.2f}x   " + ", ".join(per_shape))


if __name__ == "__main__":
    main()

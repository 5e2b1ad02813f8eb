"""oneDNN's linear on weights packed once at load, against `F.linear` (MKL's GEMM), on the
linear layers of SmolLM2-135M (fused QKV, O, fused gate/up, down; 30 layers, each with its
own float32 weights, so the weights are read from memory as in a real step, not cache).

vLLM's CPU build runs its linears through oneDNN; on this host (AMD EPYC, AVX2) MKL's SGEMM
reaches ~150-180 GFLOP/s, and this measures what oneDNN's kernels reach on the same shapes.
Both are timed in turn at each row count; it prints the median time of the 30 layers and the
ratio. (`torch.ops.mkldnn._reorder_linear_weight` / `_linear_pointwise` are the ops torch's
inductor uses for frozen CPU linears.)

    .venv/bin/python benchmarks/onednn_linear.py [--rows 1 8 32 64 128 256 512 1024 2048] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

HIDDEN, INTERMEDIATE, KV = 576, 1536, 192
SHAPES = [(HIDDEN, HIDDEN + 2 * KV), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTERMEDIATE), (INTERMEDIATE, HIDDEN)]  # (in, out)
LAYERS = 30


def packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def time_layers(rows: int, weights: list[torch.Tensor], packed: list[torch.Tensor] | None) -> float:
    """Seconds for one pass over every layer's four linears at `rows` rows."""
    inputs = {k: torch.randn(rows, k) for k, _ in SHAPES}
    passes = max(2, 256 // rows)

    def one_pass() -> None:
        for index, weight in enumerate(weights):
            x = inputs[weight.shape[1]]
            packed_linear(x, packed[index]) if packed is not None else F.linear(x, weight)

    one_pass()
    begin = time.perf_counter()
    for _ in range(passes):
        one_pass()
    return (time.perf_counter() - begin) / passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not torch.backends.mkldnn.is_available():
        raise SystemExit("this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)")
    torch.manual_seed(0)
    weights = [torch.randn(n, k) / k**0.5 for _ in range(LAYERS) for k, n in SHAPES]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 256) for w in weights]
    x = torch.randn(8, HIDDEN)
    worst = (packed_linear(x, packed[0]) - F.linear(x, weights[0])).abs().max().item()
    print(f"max |oneDNN - F.linear| on a 576-wide layer: {worst:.2e}")
    flop_per_row = 2 * LAYERS * sum(k * n for k, n in SHAPES)
    print("| rows | F.linear ms | oneDNN packed ms | ratio | F.linear GFLOP/s | oneDNN GFLOP/s |")
    print("|---|---|---|---|---|---|")
    for rows in args.rows:
        plain, fast = [], []
        for _ in range(args.repeats):
            plain.append(time_layers(rows, weights, None))
            fast.append(time_layers(rows, weights, packed))
        p, f = statistics.median(plain), statistics.median(fast)
        flop = flop_per_row * rows / 1e9
        print(f"| {rows} | {p * 1e3:.1f} | {f * 1e3:.1f} | {f / p:.2f} | {flop / p:.0f} | {flop / f:.0f} |", flush=True)


if __name__ == "__main__":
    main()

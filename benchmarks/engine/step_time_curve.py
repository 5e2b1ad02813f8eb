"""Step time against the step's row count: the curve `--chunk-align` is chosen from.

One engine runs synthetic steps (`EngineCore.time_synthetic_step`): a single prompt chunk of
n rows from position 0, for n from 1 to `--max-rows`, densely at small n and one row either
side of every multiple of 64 up to 1024 (where a GEMM tile boundary would show as a jump).
The points are measured in shuffled order, `--repeats` rounds, and each point is the median
of its rounds, so the machine's drift spreads over all of them.

It prints the curve (ms and ms per row), the jump at each probed multiple (t(m+1) - t(m)
against the curve's mean per-row cost there) and, per candidate alignment, what rounding
chunks down to it costs (the prompt rows a step gives up, on average half an alignment) and
saves (`--plot`), over the curve's range: step time, and ms per row.

    .venv/bin/python -m benchmarks.engine.step_time_curve [--max-rows 2048] [--repeats 3] [--plot docs/img/step_time_curve.png]
    .venv/bin/python -m benchmarks.engine.step_time_curve --smoke --model TINY_MODEL [--plot /tmp/curve.png]   # seconds
"""

from __future__ import annotations

import argparse
import random
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from benchmarks.support import add_model_flag, add_smoke_flag  # noqa: E402  (benchmarks/support.py)
from tqdm import tqdm  # noqa: E402

from chunkserve import LLM  # noqa: E402

PROBED_MULTIPLES = (64, 128, 192, 256, 384, 512, 768, 1024)
ALIGNMENTS = (16, 32, 64, 128)


def row_counts(max_rows: int) -> list[int]:
    points = set(range(1, 17)) | set(range(24, 257, 8)) | set(range(256, max_rows + 1, 64))
    for m in PROBED_MULTIPLES:
        points |= {m - 1, m, m + 1}
    return sorted(n for n in points if n <= max_rows)


def measure(llm: LLM, counts: list[int], repeats: int) -> dict[int, float]:
    engine = llm.engine.engine_core
    engine.time_synthetic_step([(0, min(64, max(counts)))])  # warm-up
    times: dict[int, list[float]] = {n: [] for n in counts}
    rng = random.Random(0)
    with tqdm(total=len(counts) * repeats, desc="steps", unit="step") as progress:
        for round_index in range(repeats):
            order = list(counts)
            rng.shuffle(order)
            for n in order:
                times[n].append(engine.time_synthetic_step([(0, n)], seed=round_index) * 1000)
                progress.update()
    return {n: statistics.median(t) for n, t in times.items()}


def jump_table(curve: dict[int, float]) -> list[str]:
    lines = [f"{'m':>6}{'t(m-1) ms':>11}{'t(m) ms':>10}{'t(m+1) ms':>11}{'jump ms':>9}{'ms/row':>8}"]
    for m in PROBED_MULTIPLES:
        if m + 1 not in curve:
            continue
        per_row = (curve[m + 1] - curve[m - 1]) / 2
        slope = (curve[m] - curve[1]) / (m - 1)
        lines.append(f"{m:>6}{curve[m - 1]:>11.1f}{curve[m]:>10.1f}{curve[m + 1]:>11.1f}"
                     f"{curve[m + 1] - curve[m]:>9.2f}{slope:>8.3f}   (local {per_row:.3f})")
    return lines


def alignment_table(curve: dict[int, float]) -> list[str]:
    """A chunk rounded down to a multiple of `a` loses (a - 1) / 2 rows on average; at the
    curve's mean per-row cost, that is the prompt time a cut step gives up."""
    top = max(curve)
    per_row = (curve[top] - curve[1]) / (top - 1)
    lines = [f"{'align':>6}{'rows lost/step':>16}{'ms lost/step':>14}"]
    for a in ALIGNMENTS:
        lost = (a - 1) / 2
        lines.append(f"{a:>6}{lost:>16.1f}{lost * per_row:>14.2f}")
    return lines


def plot(curve: dict[int, float], path: str) -> None:
    counts = sorted(curve)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(counts, [curve[n] for n in counts], marker=".", linewidth=1)
    left.set(xlabel="rows in the step (one prompt chunk)", ylabel="step time, ms", title="Step time")
    right.plot(counts, [curve[n] / n for n in counts], marker=".", linewidth=1)
    right.set(xscale="log", yscale="log", xlabel="rows in the step", ylabel="ms per row", title="Cost per row")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--max-rows", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plot", default=None, help="save the figure here (png)")
    add_model_flag(parser)
    add_smoke_flag(parser, "rows 1 to 16, one round (seconds): does it run?")
    args = parser.parse_args()
    if args.smoke:
        args.max_rows, args.repeats = 16, 1
    llm = LLM(args.model, max_num_batched_tokens=args.max_rows, kv_cache_memory_gb=0.5, enable_prefix_caching=False)
    curve = measure(llm, row_counts(args.max_rows), args.repeats)
    print(f"{'rows':>6}{'ms':>9}{'ms/row':>9}")
    for n, ms in sorted(curve.items()):
        print(f"{n:>6}{ms:>9.1f}{ms / n:>9.3f}")
    print()
    print("\n".join(jump_table(curve)))
    print()
    print("\n".join(alignment_table(curve)))
    if args.plot:
        plot(curve, args.plot)


if __name__ == "__main__":
    main()

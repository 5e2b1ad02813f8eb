"""Which safety margin would have kept a run's steps within the TBT SLO: replay step traces
(`--trace-steps`, written by `chunkserve bench sweep`) through `SlowdownMargin` with several
settings and count the steps that ran slower than predicted x margin (each is one gap over the
SLO for every decode in it, when the budget filled the step to the SLO), against the mean
margin (what the budget gives up: the step aims at SLO / margin).

The replay takes each step's actual / predicted as given: a different margin would have
scheduled a different chunk, but the ratio is the host's slowdown, not the chunk's size. Each
trace starts from an empty margin, refreshed every `--refit-every` steps like the predictor's.

    .venv/bin/python -m benchmarks.engine.margin_replay bench-results/*/*slo*.steps.jsonl
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from chunkserve.core.step_predictor import SlowdownMargin

SETTINGS = {  # label: (quantile, level window)
    "p99": (0.99, 0),
    "p99.5": (0.995, 0),
    "p99.9": (0.999, 0),
    "p99 x level of last 3": (0.99, 3),
    "p99 x level of last 4 (default)": (0.99, 4),
    "p99 x level of last 6": (0.99, 6),
}


def ratios(path: str) -> np.ndarray:
    with open(path) as f:
        steps = [json.loads(line) for line in f if line.strip()]
    return np.array([s["duration_s"] / s["predicted_duration_s"] for s in steps if s.get("predicted_duration_s")])


def replay(trace: np.ndarray, quantile: float, level_window: int, refit_every: int) -> tuple[int, list[float]]:
    """(steps slower than their margin, the margin each step had)."""
    margin = SlowdownMargin(quantile=quantile, level_window=level_window)
    over, margins = 0, []
    for i, ratio in enumerate(trace):
        margins.append(margin.value)
        over += ratio > margin.value
        margin.record(float(ratio))
        if (i + 1) % refit_every == 0:
            margin.update()
    return over, margins


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("traces", nargs="+", help="*.steps.jsonl files")
    parser.add_argument("--refit-every", type=int, default=8)
    args = parser.parse_args()
    traces = [ratios(path) for path in args.traces]
    total = sum(len(t) for t in traces)
    if not total:
        raise SystemExit("no step in these traces has a prediction")
    print(f"{len(traces)} traces, {total} steps with a prediction")
    print("| margin | steps over it | mean margin |")
    print("|---|---|---|")
    for label, (quantile, level_window) in SETTINGS.items():
        over, margins = 0, []
        for trace in traces:
            trace_over, trace_margins = replay(trace, quantile, level_window, args.refit_every)
            over += trace_over
            margins += trace_margins
        print(f"| {label} | {over} ({100 * over / total:.2f}%) | {np.mean(margins):.3f} |")


if __name__ == "__main__":
    main()

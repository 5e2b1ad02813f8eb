"""How well the step-time model predicted a whole run: read step traces (`--trace-steps`,
which `chunkserve bench sweep` writes for every chunkserve configuration) and print, per
trace, the relative error |predicted - actual| / actual of every step that had a prediction:
p50, p90 and p99, over all steps and split by kind (with prompt rows or decode-only), plus
how often a step ran over its prediction by more than 10%.

    .venv/bin/python benchmarks/predictor_accuracy.py bench-results/adaptive-chunking/*.steps.jsonl
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np


def errors(steps: list[dict]) -> dict[str, np.ndarray]:
    predicted = [s for s in steps if s.get("predicted_duration_s")]
    by_kind = {
        "all": predicted,
        "with prompt rows": [s for s in predicted if s["num_prefill_tokens"]],
        "decode only": [s for s in predicted if not s["num_prefill_tokens"]],
    }
    return {
        kind: np.array([(s["duration_s"], s["predicted_duration_s"]) for s in chosen]).reshape(-1, 2)
        for kind, chosen in by_kind.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("traces", nargs="+", help="step trace files (JSON lines)")
    args = parser.parse_args()
    print(f"{'trace':<34}{'steps':<18}{'n':>6}{'p50 err':>9}{'p90 err':>9}{'p99 err':>9}{'>10% over':>11}")
    for path in args.traces:
        with open(path) as f:
            steps = [json.loads(line) for line in f if line.strip()]
        name = os.path.basename(path).removesuffix(".steps.jsonl")
        for kind, pairs in errors(steps).items():
            if not len(pairs):
                continue
            actual, predicted = pairs[:, 0], pairs[:, 1]
            relative = np.abs(predicted - actual) / actual
            p50, p90, p99 = np.quantile(relative, (0.5, 0.9, 0.99))
            over = np.mean(actual > 1.1 * predicted)
            print(f"{name[:33]:<34}{kind:<18}{len(pairs):>6}{p50:>9.1%}{p90:>9.1%}{p99:>9.1%}{over:>11.1%}")


if __name__ == "__main__":
    main()

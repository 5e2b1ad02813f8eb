"""How well the step-time model predicted a whole run: read step traces (`--trace-steps`,
which `chunkserve bench sweep` writes for every chunkserve configuration) and print, per
trace, the relative error |predicted - actual| / actual of every step that had a prediction:
p50, p90 and p99, over all steps and split by kind (with prompt rows or decode-only), plus
how often a step ran over its prediction by more than 10%. For scale, the host's own noise:
the same statistics for consecutive decode-only steps with the same rows, each taken as the
"prediction" of the next (no model can do much better than the machine repeats itself).

    .venv/bin/python -m benchmarks.engine.predictor_accuracy bench-results/adaptive-chunking/*.steps.jsonl
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
    pairs = {
        kind: np.array([(s["duration_s"], s["predicted_duration_s"]) for s in chosen]).reshape(-1, 2)
        for kind, chosen in by_kind.items()
    }
    repeats = [(step["duration_s"], previous["duration_s"]) for previous, step in zip(steps, steps[1:])
               if not step["num_prefill_tokens"] and not previous["num_prefill_tokens"]
               and step["num_decode_tokens"] == previous["num_decode_tokens"]]
    pairs["noise: repeat step"] = np.array(repeats).reshape(-1, 2)
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("traces", nargs="+", help="step trace files (JSON lines)")
    args = parser.parse_args()
    print(f"{'trace':<34}{'steps':<20}{'n':>6}{'p50 err':>9}{'p90 err':>9}{'p99 err':>9}{'>10% over':>11}")
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
            print(f"{name[:33]:<34}{kind:<20}{len(pairs):>6}{p50:>9.1%}{p90:>9.1%}{p99:>9.1%}{over:>11.1%}")


if __name__ == "__main__":
    main()

"""The stall/prompt-latency trade-off of a sweep, one point per configuration: the interference
workload's decode P99 TBT (stream gaps while long prompts arrive) against the long prompts'
median TTFT, read from the sweep's summary.json, both axes logarithmic. Fixed token budgets
(labels "budget N") trace a curve in budget order; a policy that beats the trade-off sits
below and left of it.

    .venv/bin/python -m benchmarks.engine.tradeoff_plot bench-results/adaptive-chunking/summary.json \
        -o docs/img/adaptive_tradeoff.png [--slo-ms 100 250]
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("summary", help="a sweep's summary.json")
    parser.add_argument("-o", "--out", required=True, help="the PNG to write")
    parser.add_argument("--slo-ms", type=float, nargs="*", default=[], help="draw these TBT SLOs as lines")
    args = parser.parse_args()
    with open(args.summary) as f:
        rows = [r for r in json.load(f) if r.get("tbt_p99_ms") is not None and r.get("long_ttft_p50_s") is not None]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for row in rows:
        fixed = row["config"].startswith("budget")
        ax.scatter(row["long_ttft_p50_s"], row["tbt_p99_ms"], marker="o" if fixed else "*", s=40 if fixed else 140,
                   color="tab:blue" if fixed else "tab:red", zorder=3)
        ax.annotate(row["config"], (row["long_ttft_p50_s"], row["tbt_p99_ms"]), textcoords="offset points",
                    xytext=(6, 4) if fixed else (6, -12), fontsize=8, color="black" if fixed else "tab:red")
    fixed_rows = sorted((r for r in rows if r["config"].startswith("budget")),
                        key=lambda r: int(r["config"].split()[1]))
    ax.plot([r["long_ttft_p50_s"] for r in fixed_rows], [r["tbt_p99_ms"] for r in fixed_rows], color="tab:blue",
            alpha=0.4, linewidth=1, label="fixed token budgets")
    ax.set(xscale="log", yscale="log", xlabel="long-prompt TTFT p50, s",
           ylabel="decode TBT p99 during long prompts, ms",
           title="Stall against prompt latency (interference workload)")
    for slo in args.slo_ms:
        ax.axhline(slo, color="gray", linestyle="--", linewidth=0.8)
        ax.annotate(f"SLO {slo:g} ms", (0.01, slo), xycoords=("axes fraction", "data"), textcoords="offset points",
                    xytext=(0, 3), fontsize=8, color="gray")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()

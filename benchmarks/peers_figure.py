"""The fair peer set's headline (`benchmarks/peers_fair.yaml`): one figure and one table.

Reads a sweep's `summary.json` (and `machine.json`, the CPU it ran on) and groups the rounds of
each system ("chunkserve default dtype (1)" and "(2)" are one system): the median of its rounds,
the range as a whisker, for the four headline numbers: Scenario A's output tok/s, decode-1 and
decode-8 TBT p50, and Scenario B's decode TBT p99 during the long prompts with the long prompts'
TTFT p50. Prints the Markdown table docs/BENCHMARKS.md carries (with each system's ratio to
`--reference`) and writes the figure.

    .venv/bin/python benchmarks/peers_figure.py bench-results/peers-fair -o docs/img/peers_fair.png
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

# (title, how to read it from a summary row, unit, whether higher is better)
METRICS = [
    ("Scenario A throughput", lambda row: row["workloads"]["scenario-a"]["output_tok_s"], "out tok/s", True),
    ("decode-1 TBT p50", lambda row: row["workloads"]["decode-1"]["tbt_p50_ms"], "ms", False),
    ("decode-8 TBT p50", lambda row: row["workloads"]["decode-8"]["tbt_p50_ms"], "ms", False),
    ("Scenario B TBT p99 during long prompts", lambda row: row["tbt_p99_ms"], "ms", False),
    ("Scenario B long-prompt TTFT p50", lambda row: row["long_ttft_p50_s"], "s", False),
]


def system_of(label: str) -> str:
    """A configuration's label without its round: "vLLM default dtype (2)" -> "vLLM default dtype"."""
    return re.sub(r"\s*\(\d+\)$", "", label)


def by_system(rows: list[dict]) -> dict[str, list[list[float]]]:
    """Each system's values per metric, one per round, in the order of first appearance."""
    systems: dict[str, list[list[float]]] = {}
    for row in rows:
        values = systems.setdefault(system_of(row["config"]), [[] for _ in METRICS])
        for index, (_, read, _, _) in enumerate(METRICS):
            try:
                values[index].append(float(read(row)))
            except (KeyError, TypeError):  # a failed configuration has no numbers
                pass
    return systems


def number(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def table(systems: dict[str, list[list[float]]], reference: str) -> str:
    header = "| system | " + " | ".join(f"{title} ({unit})" for title, _, unit, _ in METRICS) + " |"
    lines = [header, "|---" * (len(METRICS) + 1) + "|"]
    medians = {name: [statistics.median(v) if v else None for v in values] for name, values in systems.items()}
    for name, values in systems.items():
        cells = []
        for index, runs in enumerate(values):
            if not runs:
                cells.append("-")
                continue
            median, base = medians[name][index], medians.get(reference, [None] * len(METRICS))[index]
            cell = number(median)
            if len(runs) > 1:
                cell += f" ({number(min(runs))}-{number(max(runs))})"
            if base and name != reference:
                cell += f", **{median / base:.2f}x**"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def figure(systems: dict[str, list[list[float]]], machine: dict, path: str) -> None:
    names = list(systems)
    fig, axes = plt.subplots(1, len(METRICS), figsize=(4.2 * len(METRICS), 0.45 * len(names) + 1.8), sharey=True)
    colors = ["#1f77b4" if name.startswith("chunkserve") else "#ff7f0e" if name.startswith("vLLM") else "#2ca02c"
              for name in names]
    for ax, (index, (title, _, unit, higher)) in zip(axes, enumerate(METRICS)):
        medians = [statistics.median(systems[n][index]) if systems[n][index] else 0 for n in names]
        low = [m - min(systems[n][index]) if systems[n][index] else 0 for m, n in zip(medians, names)]
        high = [max(systems[n][index]) - m if systems[n][index] else 0 for m, n in zip(medians, names)]
        ax.barh(range(len(names)), medians, xerr=[low, high], color=colors, capsize=3)
        ax.set_title(f"{title}\n({unit}, {'higher' if higher else 'lower'} is better)", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
        if max(medians) > 20 * min(m for m in medians if m > 0):  # Scenario B's p99 spans 100x: a log axis
            ax.set_xscale("log")
        for y, (value, above) in enumerate(zip(medians, high)):
            ax.text(value + above, y, f" {number(value)}", va="center", fontsize=7)
    axes[0].set_yticks(range(len(names)), names, fontsize=8)
    axes[0].invert_yaxis()
    flags = set(machine.get("avx512_flags", "").split()) & {"avx512f", "avx512_bf16", "avx512_vnni"}
    fig.suptitle(f"SmolLM2-135M-Instruct, every server at its default flags; {machine.get('cpu', '?')} "
                 f"(family {machine.get('cpu_family', '?')} model {machine.get('cpu_model', '?')}), "
                 f"{machine.get('cpus', '?')} CPUs, {' '.join(sorted(flags)) or 'no AVX-512'}; "
                 f"{machine.get('date', '?')}, chunkserve {machine.get('commit', '?')}; "
                 "median of the rounds, whiskers the range", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("out_dir", help="the sweep's out_dir (summary.json, machine.json)")
    parser.add_argument("-o", "--output", required=True, help="the figure's PNG path")
    parser.add_argument("--reference", default="vLLM default dtype", help="the system the ratios are to")
    args = parser.parse_args()
    with open(os.path.join(args.out_dir, "summary.json")) as f:
        rows = json.load(f)
    machine_path = os.path.join(args.out_dir, "machine.json")
    machine = {}
    if os.path.exists(machine_path):
        with open(machine_path) as f:
            machine = json.load(f)
    systems = by_system(rows)
    print(table(systems, args.reference))
    figure(systems, machine, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

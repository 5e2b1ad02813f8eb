"""What `chunkserve sim` answers beyond one run: the highest request rate that meets SLOs
(`search_rate`, by bisection, as Vidur-Search and DistServe's placement search do), and a sweep
file's configurations through its workloads, ranked (`run_sweep`: `chunkserve bench sweep`'s
file and tables, every server simulated instead of started).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from chunkserve.bench import serve as bench_serve
from chunkserve.bench import sweep as bench_sweep
from chunkserve.errors import InvalidRequestError

SLO_METRICS = ("ttft", "tbt", "tpot", "e2e")
SLO_PERCENTILES = ("p50", "p90", "p99", "max", "mean")


@dataclass(frozen=True)
class SLO:
    """`metric`'s `percentile` over the run's requests at most `bound_ms`."""

    metric: str
    percentile: str
    bound_ms: float

    @classmethod
    def parse(cls, text: str) -> SLO:
        """`ttft_p90=2000`: TTFT's p90 at most 2000 ms."""
        name, _, bound = text.partition("=")
        metric, _, percentile = name.partition("_")
        try:
            value = float(bound)
        except ValueError:
            value = -1.0
        if metric not in SLO_METRICS or percentile not in SLO_PERCENTILES or not value > 0:
            raise InvalidRequestError(f"--slo {text!r}: expected METRIC_PERCENTILE=MS with METRIC one of "
                                      f"{', '.join(SLO_METRICS)} and PERCENTILE one of {', '.join(SLO_PERCENTILES)}, "
                                      "e.g. ttft_p90=2000 tbt_p99=300")
        return cls(metric, percentile, value)

    def met_by(self, summary: dict[str, Any]) -> bool:
        value = summary[f"{self.metric}_ms"][self.percentile]
        return summary["failed"] == 0 and value is not None and value <= self.bound_ms

    def __str__(self) -> str:
        return f"{self.metric}_{self.percentile}<={self.bound_ms:g}ms"


def search_rate(run_at: Callable[[float], dict[str, Any]], slos: list[SLO], min_rate: float, max_rate: float,
                tolerance: float = 0.02, max_probes: int = 24) -> tuple[float | None, list[dict[str, Any]]]:
    """The highest Poisson rate in [min_rate, max_rate] whose run (`run_at(rate)`'s summary)
    meets every SLO, to within `tolerance` of it; None when even `min_rate` fails. Assumes
    the SLOs hold below some rate and fail above it (more load never shortens a queue)."""
    if not 0 < min_rate < max_rate:
        raise InvalidRequestError(f"the rate search needs 0 < --min-rate < --max-rate, got {min_rate}, {max_rate}")
    probes: list[dict[str, Any]] = []

    def passes(rate: float) -> bool:
        summary = run_at(rate)
        passed = all(slo.met_by(summary) for slo in slos)
        probes.append({"rate": rate, "passed": passed,
                       **{str(slo): summary[f"{slo.metric}_ms"][slo.percentile] for slo in slos}})
        return passed

    if passes(max_rate):
        return max_rate, probes
    if not passes(min_rate):
        return None, probes
    low, high = min_rate, max_rate
    while high - low > tolerance * low and len(probes) < max_probes:
        middle = (low + high) / 2
        if passes(middle):
            low = middle
        else:
            high = middle
    return low, probes


def bench_flags_parser() -> argparse.ArgumentParser:
    """`bench serve`'s workload flags, as a sweep file's workloads give them."""
    parser = argparse.ArgumentParser(add_help=False)
    bench_serve.add_workload_arguments(parser)
    bench_serve.add_result_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def run_sweep(sweep: bench_sweep.SweepConfig, simulate_config: Callable[[list[str], argparse.Namespace, str], dict],
              log: Callable[[str], None] = print) -> tuple[str, list[dict[str, Any]]]:
    """Every configuration of `sweep` (chunkserve's only: a peer's start command cannot be
    simulated) through its workloads and capacity probes, each simulated by
    `simulate_config(serve flags, workload flags, label)`, results written as `bench sweep`
    writes them; returns its tables plus a ranking, and the rows."""
    os.makedirs(sweep.out_dir, exist_ok=True)
    parser = bench_flags_parser()
    configs = [c for c in sweep.configs if not c.command]
    for config in configs:
        serve_flags = [*sweep.server_args, *config.args]
        log(f"{config.label}: simulating")
        for name, flags in bench_sweep.workload_flags(sweep.workloads).items():
            result = simulate_config(serve_flags, parser.parse_args(flags), config.label)
            bench_serve.write_json(result, os.path.join(sweep.out_dir, f"{config.slug}.{name}.json"))
        if sweep.capacity:
            def probe(flags: list[str], label: str, path: str | None, serve_flags=serve_flags) -> dict:
                result = simulate_config(serve_flags, parser.parse_args(flags), label)
                if path:
                    bench_serve.write_json(result, path)
                return result

            bench_sweep.capacity_search(sweep, config, probe)
    rows = [bench_sweep.summary_row(sweep, config) for config in configs]
    tables = bench_sweep.summary_table(rows) + "\n\nPer workload:\n\n" + bench_sweep.workload_table(rows)
    if sweep.capacity:
        tables += "\n\n" + bench_sweep.capacity_table(rows, sweep.capacity)
    return tables + "\n\n" + ranking(rows), rows


def ranking(rows: list[dict[str, Any]]) -> str:
    """The configurations best first: by capacity when the sweep searched it, else by output
    tokens/s of the first workload without long prompts."""
    key = "capacity_rps" if any(row.get("capacity_rps") is not None for row in rows) else "output_tok_s"
    ordered = sorted(rows, key=lambda row: -(row.get(key) or 0.0))
    unit = "req/s capacity" if key == "capacity_rps" else "output tok/s"
    cells = [f"{row['config']} ({'-' if row.get(key) is None else format(row[key], '.2f')})" for row in ordered]
    return f"Ranking ({unit}): " + " > ".join(cells)

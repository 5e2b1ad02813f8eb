"""How close `chunkserve sim` comes to real runs (issue 43): simulate every configuration and
workload of a real `chunkserve bench sweep` (benchmarks/engine/sim_accuracy.yaml) and compare
TTFT and TBT medians, TBT p99, output tokens/s, capacity under the SLO and the ranking of the
configurations, with two kinds of profile, neither fitted on the run it predicts:

- `held-out run`: one profile (`--profile`) from another run (sim_profile.yaml: another budget,
  other workloads), as a user would make one;
- `leave one out`: for each configuration, a profile fitted on the real traces (and request
  latency on the bench results) of every other configuration of the sweep.

    chunkserve bench sweep --config benchmarks/engine/sim_profile.yaml
    chunkserve profile bench-results/sim-profile/*.steps.jsonl -o profile.json --max-num-batched-tokens 256 \\
        --kv-cache-memory-gb 1 --bench-result bench-results/sim-profile/budget-256.random.json
    chunkserve bench sweep --config benchmarks/engine/sim_accuracy.yaml
    .venv/bin/python -m benchmarks.engine.sim_accuracy --profile profile.json --out bench-results/sim-accuracy-report

Targets (the issue's): medians within 10%, TBT p99 within 20%, output tokens/s within 5%,
capacity within 10%, the same ranking (Spearman 1.0).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import numpy as np
import yaml

from chunkserve.bench import sweep as bench_sweep
from chunkserve.entrypoints import cli
from chunkserve.entrypoints.sim_commands import request_latency
from chunkserve.entrypoints.sim_cli import add_sim_arguments, engine_args_of
from chunkserve.sim.profile import StepTimeProfile, fit_profile, read_trace
from benchmarks.support import add_smoke_flag

METRICS = (  # (label, workload cell, target relative error)
    ("TTFT p50", "ttft_p50_ms", 0.10),
    ("TBT p50", "tbt_p50_ms", 0.10),
    ("TBT p99", "tbt_p99_ms", 0.20),
    ("out tok/s", "output_tok_s", 0.05),
)
RANKED_BY = {"interference": "tbt_p99_ms", "sharegpt-like": "ttft_p50_ms", "prefix": "ttft_p50_ms",
             "multi-turn": "ttft_p50_ms"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--config", default="benchmarks/engine/sim_accuracy.yaml", help="the real sweep's file")
    parser.add_argument("--real", default=None, help="the real sweep's out_dir (default: the file's)")
    parser.add_argument("--profile", help="the held-out run's profile")
    parser.add_argument("--no-leave-one-out", action="store_true", help="only the held-out profile")
    parser.add_argument("--out", default="bench-results/sim-accuracy-report")
    add_smoke_flag(parser, "simulate a two-configuration sweep against itself on a synthetic profile (no real run)")
    args = parser.parse_args()
    if args.smoke:
        return smoke(args.out)
    sweep = bench_sweep.SweepConfig.load(args.config)
    real_dir = args.real or sweep.out_dir
    os.makedirs(args.out, exist_ok=True)
    real = rows_of(sweep, real_dir)
    reports = {}
    if args.profile:
        reports["held-out run"] = simulate_sweep(args.config, sweep, args.profile, os.path.join(args.out, "held-out"))
    if not args.no_leave_one_out:
        reports["leave one out"] = leave_one_out(args.config, sweep, real_dir, os.path.join(args.out, "loo"))
    text = "\n\n".join(report(name, sweep, real, simulated, wall) for name, (simulated, wall) in reports.items())
    print(text)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump({"real": real, **{name: rows for name, (rows, _) in reports.items()}}, f, indent=1)


def rows_of(sweep: bench_sweep.SweepConfig, out_dir: str) -> dict[str, dict]:
    local = dataclasses.replace(sweep, out_dir=out_dir)
    return {c.label: bench_sweep.summary_row(local, c) for c in sweep.configs}


def simulate_sweep(config_path: str, sweep: bench_sweep.SweepConfig, profile: str, out_dir: str,
                   only: str | None = None) -> tuple[dict[str, dict], float]:
    """`chunkserve sim --sweep` on the file (or one configuration of it); its rows and wall seconds."""
    path = config_path
    if only is not None:
        with open(config_path) as f:
            raw = yaml.safe_load(f)
        raw["configs"] = [c for c in raw["configs"] if c["label"] == only]
        path = os.path.join(out_dir, "sweep.yaml")
        os.makedirs(out_dir, exist_ok=True)
        with open(path, "w") as f:
            yaml.safe_dump(raw, f)
    started = time.perf_counter()
    cli.main(["sim", "--sweep", path, "--profile", profile, "--out-dir", out_dir])
    wall = time.perf_counter() - started
    local = dataclasses.replace(sweep, out_dir=out_dir)
    return {c.label: bench_sweep.summary_row(local, c) for c in sweep.configs if only in (None, c.label)}, wall


def leave_one_out(config_path: str, sweep: bench_sweep.SweepConfig, real_dir: str,
                  out_dir: str) -> tuple[dict[str, dict], float]:
    """Each configuration simulated on a profile of the others' real runs."""
    rows, wall = {}, 0.0
    for config in sweep.configs:
        others = [c for c in sweep.configs if c is not config]
        records = [r for c in others for r in read_trace(os.path.join(real_dir, f"{c.slug}.steps.jsonl"))]
        profile = fit_profile(records, provenance={"source": f"real traces of every configuration but {config.label}"})
        latencies = []
        for other in others:
            engine_args = engine_args_of(sim_namespace([*sweep.server_args, *other.args]))
            results = [os.path.join(real_dir, f"{other.slug}.{name}.json") for name in sweep.workloads
                       if name != "interference"]
            latencies.append(request_latency(profile, engine_args, results))
        profile = dataclasses.replace(profile, request_latency_s=float(np.median(latencies)))
        folder = os.path.join(out_dir, config.slug)
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "profile.json")
        profile.save(path)
        simulated, seconds = simulate_sweep(config_path, sweep, path, folder, only=config.label)
        rows.update(simulated)
        wall += seconds
    return rows, wall


def sim_namespace(flags: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    return parser.parse_args(flags)


def error(simulated: float | None, real: float | None) -> float | None:
    return None if simulated is None or not real else simulated / real - 1


def spearman(a: list[float], b: list[float]) -> float:
    ranks_a, ranks_b = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ranks_a, ranks_b)[0, 1]) if len(a) > 1 else 1.0


def report(name: str, sweep: bench_sweep.SweepConfig, real: dict, simulated: dict, wall: float) -> str:
    """Markdown: errors per configuration and workload, capacity, rankings, targets met."""
    lines = [f"### Profile: {name}", "", "| workload | config | " + " | ".join(
        f"{label} real / sim (err)" for label, _, _ in METRICS) + " |", "|---|---|" + "---|" * len(METRICS)]
    errors: dict[str, list[float]] = {key: [] for _, key, _ in METRICS}
    for workload in sweep.workloads:
        for config in sweep.configs:
            r, s = real[config.label]["workloads"].get(workload), simulated[config.label]["workloads"].get(workload)
            if r is None or s is None:
                continue
            cells = []
            for _, key, _ in METRICS:
                e = error(s[key], r[key])
                if e is not None:
                    errors[key].append(abs(e))
                cells.append(f"{r[key]:.1f} / {s[key]:.1f} ({e:+.0%})" if e is not None else "-")
            lines.append(f"| {workload} | {config.label} | " + " | ".join(cells) + " |")
    lines += ["", "| metric | median abs error | max abs error | target | met |", "|---|---|---|---|---|"]
    for label, key, target in METRICS:
        values = errors[key]
        if values:
            lines.append(f"| {label} | {np.median(values):.1%} | {max(values):.1%} | {target:.0%} | "
                         f"{'yes' if max(values) <= target else 'no'} |")
    if sweep.capacity:
        lines += ["", "| config | capacity real req/s | sim | error |", "|---|---|---|---|"]
        for config in sweep.configs:
            r, s = real[config.label].get("capacity_rps"), simulated[config.label].get("capacity_rps")
            e = error(s, r)
            lines.append(f"| {config.label} | {r} | {s} | {'-' if e is None else f'{e:+.0%}'} |")
    lines += ["", "Ranking of the configurations (Spearman rank correlation, 1.0 = the same order):"]
    for workload, key in RANKED_BY.items():
        pairs = [(real[c.label]["workloads"][workload][key], simulated[c.label]["workloads"][workload][key])
                 for c in sweep.configs if workload in real[c.label]["workloads"]
                 and workload in simulated[c.label]["workloads"]]
        if pairs:
            lines.append(f"- {workload} by {key}: {spearman(*map(list, zip(*pairs))):.2f}")
    durations = [real[c.label]["workloads"] for c in sweep.configs]
    lines.append(f"\nSimulating it took {wall:.1f} s ({len(durations)} configurations).")
    return "\n".join(lines)


def smoke(out: str) -> None:
    """The script's plumbing on a tiny sweep: a synthetic profile, a sweep simulated twice (as 'real' and as sim)."""
    os.makedirs(out, exist_ok=True)
    profile = os.path.join(out, "profile.json")
    StepTimeProfile({"constant": 0.009, "prefill_rows": 8e-4, "decode_rows": 2e-3}).save(profile)
    config = os.path.join(out, "sweep.yaml")
    with open(config, "w") as f:
        yaml.safe_dump({"out_dir": os.path.join(out, "real"), "server_args": ["--kv-cache-memory-gb", "1"],
                        "configs": [{"label": "budget 64", "args": ["--max-num-batched-tokens", "64"]},
                                    {"label": "budget 512", "args": ["--max-num-batched-tokens", "512"]}],
                        "workloads": {"sharegpt-like": ["--workload", "sharegpt-like", "--num-prompts", "6",
                                                        "--request-rate", "2"]}}, f)
    sweep = bench_sweep.SweepConfig.load(config)
    real, _ = simulate_sweep(config, sweep, profile, sweep.out_dir)
    simulated, wall = simulate_sweep(config, sweep, profile, os.path.join(out, "sim"))
    print(report("smoke (the same profile twice)", sweep, real, simulated, wall))


if __name__ == "__main__":
    main()

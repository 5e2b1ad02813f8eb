"""The compact result files the documentation's figures are drawn from (docs/data/*.json), and the
one `chunkserve bench sweep` writes beside its results (`figure_data.json`).

Raw result files are too large to commit and disappear with the worktree that ran them; these
keep, per configuration, the numbers a figure shows and where they come from, so a figure can be
redrawn from the repository alone. The format:

    {"title": "The fair peer set, run 6",
     "source": {"command": "...", "commit": "35f58a6", "cpu": "...", "date": "2026-11-28 07:08 UTC",
                "log_section": "The fair peer set, run 6"},      # null where not logged yet
     "reference": "vLLM CPU, default dtype",                        # optional: the label ratios are to
     "configs": [{"label": "...", "dtype": "bfloat16", "args": [...],   # dtype and args optional
                  "values": {"scenario-a.output_tok_s": {"median": 413, "low": 411, "high": 414, "ratio": 0.95},
                             "tbt_p99_ms": 292}}]}

A value is a number (one run) or the median of several rounds with their range (`low`, `high`),
optionally the rounds themselves and the ratio to the reference as the text quotes it. Metric
names are the sweep's summary keys; a workload's own numbers are `WORKLOAD.KEY`.
"""

from __future__ import annotations

import json
import os
import re
import statistics
from typing import Any

SOURCE_KEYS = ("command", "commit", "cpu", "date", "log_section")
CONFIG_KEYS = ("label", "values")
FILE_NAME = "figure_data.json"
CAPACITY_PREFIX = "capacity_rps_slo_"
ROW_METRICS = ("long_ttft_p50_s", "short_ttft_p50_ms", "tbt_p50_ms", "tbt_p99_ms", "tbt_max_ms", "output_tok_s")


def load(path: str) -> dict:
    """Read and check a compact result file; a missing key is a ValueError naming the file and the key."""
    with open(path, encoding="utf-8") as file:
        try:
            data = json.load(file)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error})") from error
    validate(data, path)
    return data


def validate(data: Any, where: str) -> None:
    """The keys every figure needs: the source of the numbers and a label and values per configuration."""
    _require(data, ("source", "configs"), where)
    _require(data["source"], SOURCE_KEYS, f"{where}: source")
    if not isinstance(data["configs"], list) or not data["configs"]:
        raise ValueError(f"{where}: configs: expected a non-empty list of configurations")
    for index, config in enumerate(data["configs"]):
        _require(config, CONFIG_KEYS, f"{where}: configs[{index}]")


def require_metrics(data: dict, metrics: tuple[str, ...], where: str) -> None:
    """Every configuration has a value for each of `metrics` (a figure kind's inputs)."""
    for index, config in enumerate(data["configs"]):
        missing = [metric for metric in metrics if metric not in config["values"]]
        if missing:
            raise ValueError(f"{where}: configs[{index}] ({config['label']!r}): values missing {', '.join(missing)}")


def require_fields(data: dict, fields: tuple[str, ...], where: str) -> None:
    """Every configuration names each of `fields` (e.g. the workload and mode a figure groups by)."""
    for index, config in enumerate(data["configs"]):
        _require(config, fields, f"{where}: configs[{index}] ({config['label']!r})")


def median(value: float | dict) -> float:
    """The value itself, or the median of its rounds."""
    return float(value["median"]) if isinstance(value, dict) else float(value)


def spread(value: float | dict) -> tuple[float, float] | None:
    """The range of the rounds (low, high), None for a single run."""
    return (float(value["low"]), float(value["high"])) if isinstance(value, dict) and "low" in value else None


def quoted_ratio(value: float | dict) -> float | None:
    """The ratio to the reference as the source quotes it, if it does."""
    return value.get("ratio") if isinstance(value, dict) else None


def _require(obj: Any, keys: tuple[str, ...], where: str) -> None:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {json.dumps(obj)[:40]}")
    missing = [key for key in keys if key not in obj]
    if missing:
        raise ValueError(f"{where}: missing required key(s): {', '.join(missing)}")


# ---- written by `chunkserve bench sweep` ------------------------------------------------------


def system_of(label: str) -> str:
    """A configuration's label without its round: "vLLM default dtype (2)" -> "vLLM default dtype"."""
    return re.sub(r"\s*\(\d+\)$", "", label)


def row_values(row: dict, slo_tbt_ms: float | None) -> dict[str, float]:
    """A sweep summary row's numbers under their metric names (absent where the row has none)."""
    values = {key: row[key] for key in ROW_METRICS if row.get(key) is not None}
    for workload, cells in row.get("workloads", {}).items():
        values.update({f"{workload}.{key}": cell for key, cell in cells.items() if cell is not None})
    if slo_tbt_ms is not None and row.get("capacity_rps") is not None:
        values[f"{CAPACITY_PREFIX}{slo_tbt_ms:g}ms"] = row["capacity_rps"]
    return values


def combine_rounds(rounds: list[float]) -> float | dict:
    """One run's number as is; several rounds as their median, range and the rounds."""
    if len(rounds) == 1:
        return rounds[0]
    return {"median": statistics.median(rounds), "low": min(rounds), "high": max(rounds), "rounds": rounds}


def sweep_data(rows: list[dict], commands: dict[str, list[str]], machine: dict, config_path: str,
               slo_tbt_ms: float | None) -> dict:
    """The compact file of a sweep: its rounds of one system (labels "X (1)", "X (2)") combined,
    systems without a number (every round failed) left out."""
    systems: dict[str, dict[str, list[float]]] = {}
    args: dict[str, list[str]] = {}
    for row in rows:
        system = system_of(row["config"])
        args.setdefault(system, commands.get(row["config"], []))
        for metric, value in row_values(row, slo_tbt_ms).items():
            systems.setdefault(system, {}).setdefault(metric, []).append(value)
    configs = [{"label": system, "dtype": _dtype(args[system]), "args": args[system],
                "values": {metric: combine_rounds(rounds) for metric, rounds in metrics.items()}}
               for system, metrics in systems.items()]
    flags = " ".join(sorted(set(str(machine.get("avx512_flags", "")).split()))) or "no AVX-512"
    cpu = (f"{machine.get('cpu', '?')} (family {machine.get('cpu_family', '?')} model "
           f"{machine.get('cpu_model', '?')}), {machine.get('cpus', '?')} CPUs, {flags}")
    source = {"command": f"chunkserve bench sweep --config {config_path}", "commit": machine.get("commit"),
              "cpu": cpu, "date": machine.get("date"), "log_section": None}
    return {"title": os.path.splitext(os.path.basename(config_path))[0], "source": source, "configs": configs}


def write_sweep_data(out_dir: str, rows: list[dict], commands: dict[str, list[str]], config_path: str,
                     slo_tbt_ms: float | None) -> str:
    """Write `figure_data.json` into the sweep's out_dir (the CPU from its machine.json) and return its path."""
    machine_path = os.path.join(out_dir, "machine.json")
    machine = {}
    if os.path.exists(machine_path):
        with open(machine_path, encoding="utf-8") as file:
            machine = json.load(file)
    path = os.path.join(out_dir, FILE_NAME)
    data = sweep_data(rows, commands, machine, config_path, slo_tbt_ms)
    if os.path.exists(path):
        try:
            _keep_other_capacities(data, load(path))
        except ValueError:  # an unreadable earlier file is replaced
            pass
    with open(path, "w", encoding="utf-8") as file:
        json.dump(data, file, indent=2)
    return path


def _keep_other_capacities(data: dict, earlier: dict) -> None:
    """Keep the capacities the same run's probes were judged at under other SLOs (`--summarize-only
    --slo-tbt-ms N` re-judges them at N): same run means the same machine.json date."""
    if earlier["source"].get("date") != data["source"].get("date"):
        return
    earlier_values = {config["label"]: config["values"] for config in earlier["configs"]}
    for config in data["configs"]:
        for metric, value in earlier_values.get(config["label"], {}).items():
            if metric.startswith(CAPACITY_PREFIX):
                config["values"].setdefault(metric, value)


def _dtype(args: list[str]) -> str:
    """The `--dtype` a configuration passes, else "default dtype" (its server log names what that resolved to)."""
    if "--dtype" in args[:-1]:
        return args[args.index("--dtype") + 1]
    return "default dtype"

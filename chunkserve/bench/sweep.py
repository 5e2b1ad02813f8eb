"""`chunkserve bench sweep --config sweep.yaml`: every server configuration through the same
workloads, one summary table.

For each configuration the sweep starts a server (ours, or any command that starts an
OpenAI-compatible server, e.g. a peer), waits for /health, runs the workloads with
`bench serve` in-process, searches the capacity, stops the server (SIGTERM to its process
group, SIGKILL after a minute: chunkserve/bench/service.py), and keeps
every result file (and ours' step traces) in the output folder.

Capacity is Sarathi-Serve's metric: the highest request rate whose P99 TBT stays under
the SLO while the server keeps up. TBT alone cannot see overload (a request waiting in the
queue has no tokens yet), so, as Sarathi-Serve bounds the median scheduling delay, a probe
also fails when the median TTFT exceeds `max_median_ttft_s` (TTFT is the closest the client
sees: the queueing delay plus the prompt's own prefill). It is found by bisection over
`[min_rate, max_rate]`: each probe runs the capacity workload at one rate, `probes` probes
narrow the interval, and the capacity is the highest probed rate that passed ("< r" in the
table when even the lowest probed rate r failed). Each probe draws new prompts (its own
seed), so a server's prefix cache cannot make a later probe cheaper; so does each workload,
unless its flags give a `--seed`.

The tables are built from the result files, so `--summarize-only` rebuilds them without
running anything, e.g. to judge the same probes against another SLO (`--slo-tbt-ms`).

The config file (YAML):

    out_dir: bench-results/sweep           # results, traces, summary.md, summary.json, machine.json,
                                           # figure_data.json (`chunkserve bench plot --figure`)
    port: 8100
    server_args: [--kv-cache-memory-gb, "1"]   # added to every chunkserve configuration
    configs:
      - {label: chunking off, args: [--no-enable-chunked-prefill]}
      - {label: chunked 256, args: [--max-num-batched-tokens, "256"]}
      - label: vLLM 256                        # a peer: any command; {port} is substituted
        command: [benchmarks/peers/start_vllm.sh, "{port}", --max-num-batched-tokens, "256"]
        model: SmolLM2-135M-Instruct
        startup_timeout_s: 300
    workloads:                                 # name -> `bench serve` flags
      interference: [--workload, interference, --streams, "8"]
      throughput: [--workload, random, --num-prompts, "32", --input-len, "256", --output-len, "64"]
    capacity:                                  # optional
      slo_tbt_ms: 500
      max_median_ttft_s: 2                     # optional
      min_rate: 0.25
      max_rate: 4
      probes: 4
      args: [--workload, sharegpt-like, --num-prompts, "16"]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from chunkserve.bench import figure_data
from chunkserve.bench import serve as bench_serve
from chunkserve.bench.host import machine
from chunkserve.bench.service import Service

CAPACITY_SEED = 1000


@dataclass
class ServerConfig:
    label: str
    args: list[str] = field(default_factory=list)  # chunkserve serve flags
    command: list[str] | None = None  # a peer's start command instead of chunkserve
    model: str | None = None
    startup_timeout_s: float = 300.0

    @property
    def slug(self) -> str:
        return "".join(c if c.isalnum() else "-" for c in self.label.lower()).strip("-")


@dataclass
class SweepConfig:
    out_dir: str
    port: int
    server_args: list[str]
    configs: list[ServerConfig]
    workloads: dict[str, list[str]]
    capacity: dict[str, Any] | None

    @classmethod
    def load(cls, path: str) -> SweepConfig:
        import yaml

        with open(path) as f:
            raw = yaml.safe_load(f)
        missing = {"configs", "workloads"} - set(raw)
        if missing:
            raise ValueError(f"{path}: missing {sorted(missing)}")
        return cls(
            out_dir=raw.get("out_dir", "bench-results/sweep"),
            port=int(raw.get("port", 8100)),
            server_args=[str(a) for a in raw.get("server_args", [])],
            configs=[ServerConfig(**{**c, "args": [str(a) for a in c.get("args", [])]}) for c in raw["configs"]],
            workloads={name: [str(a) for a in flags] for name, flags in raw["workloads"].items()},
            capacity=raw.get("capacity"),
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="the sweep's YAML file (see the module docstring)")
    parser.add_argument("--only", nargs="*", help="run only the configurations with these labels")
    parser.add_argument("--summarize-only", action="store_true",
                        help="run nothing: rebuild the tables from the result files already in out_dir")
    parser.add_argument("--slo-tbt-ms", type=float, default=None,
                        help="judge the capacity probes against this P99 TBT SLO instead of the config's")


def main(args: argparse.Namespace) -> None:
    sweep = SweepConfig.load(args.config)
    if args.slo_tbt_ms is not None and sweep.capacity:
        sweep.capacity = {**sweep.capacity, "slo_tbt_ms": args.slo_tbt_ms}
    configs = [c for c in sweep.configs if not args.only or c.label in args.only]
    os.makedirs(sweep.out_dir, exist_ok=True)
    if not args.summarize_only:  # every number names its CPU: the host of the run, kept beside its results
        with open(os.path.join(sweep.out_dir, "machine.json"), "w") as f:
            json.dump({**machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, f, indent=2)
    errors = {} if args.summarize_only else {c.label: run_config_or_report(sweep, c) for c in configs}
    rows = [summary_row(sweep, c, errors.get(c.label)) for c in configs]
    tables = summary_table(rows) + "\n\nPer workload:\n\n" + workload_table(rows)
    if sweep.capacity:
        tables += "\n\n" + capacity_table(rows, sweep.capacity)
    print(tables)
    with open(os.path.join(sweep.out_dir, "summary.md"), "w") as f:
        f.write(tables + "\n")
    with open(os.path.join(sweep.out_dir, "summary.json"), "w") as f:
        json.dump(rows, f, indent=2)
    figure_data.write_sweep_data(sweep.out_dir, rows, {c.label: c.command or c.args for c in configs}, args.config,
                                 sweep.capacity["slo_tbt_ms"] if sweep.capacity else None)


def run_config_or_report(sweep: SweepConfig, config: ServerConfig) -> str | None:
    """``run_config``; None, or why it failed (a peer not installed, a server that crashed):
    one configuration's failure must not lose the others' results."""
    try:
        run_config(sweep, config)
        return None
    except (OSError, RuntimeError, httpx.HTTPError) as error:
        log(f"{config.label}: FAILED: {type(error).__name__}: {error}")
        return f"{type(error).__name__}: {error}"


def run_config(sweep: SweepConfig, config: ServerConfig) -> None:
    """Start the server, run every workload and the capacity search into out_dir, stop it."""
    for name in os.listdir(sweep.out_dir):  # an earlier run's files of this configuration
        if name.startswith(config.slug + "."):
            os.remove(os.path.join(sweep.out_dir, name))
    log(f"{config.label}: starting the server")
    with _server(sweep, config) as server:
        server.wait_healthy()
        base_url = server.url
        for name, flags in workload_flags(sweep.workloads).items():
            log(f"{config.label}: workload {name}")
            _bench(base_url, config, flags, config.label, _result_path(sweep, config, name))
        if sweep.capacity:
            _capacity(base_url, config, sweep)


def workload_flags(workloads: dict[str, list[str]]) -> dict[str, list[str]]:
    """Each workload's flags, with its own `--seed` (its position) unless it names one: the
    workloads run against one server, and with the same seed they draw the same prompt
    tokens, which its prefix cache would then serve instead of computing."""
    return {name: flags if "--seed" in flags else [*flags, "--seed", str(index)]
            for index, (name, flags) in enumerate(workloads.items())}


def summary_row(sweep: SweepConfig, config: ServerConfig, error: str | None = None) -> dict[str, Any]:
    """The table's numbers for one configuration, read from its result files in out_dir
    (None where a workload is absent)."""
    results = {name: _load(_result_path(sweep, config, name)) for name in sweep.workloads}
    results = {name: result for name, result in results.items() if result is not None}
    row: dict[str, Any] = {"config": config.label,
                           "workloads": {name: workload_cells(r["summary"]) for name, r in results.items()}}
    if error or not results:
        row["error"] = error or f"no result files in {sweep.out_dir} (run the sweep first)"
    interference = next((r["interference"] for r in results.values() if r.get("interference")), None)
    if interference:
        row["long_ttft_p50_s"] = _ms_to_s(interference["long_ttft_ms"]["p50"])
        for stat in ("p50", "p99", "max"):
            row[f"tbt_{stat}_ms"] = interference["tbt_during_long_ms"][stat]
    throughput = next((r for r in results.values() if not r.get("interference")), None)
    if throughput:
        row["short_ttft_p50_ms"] = throughput["summary"]["ttft_ms"]["p50"]
        row["output_tok_s"] = throughput["summary"]["output_token_throughput"]
    if sweep.capacity:
        probes = [probe_record(result["config"]["request_rate"], result["summary"], sweep.capacity)
                  for result in _capacity_results(sweep, config)]
        row["capacity_probes"] = sorted(probes, key=lambda probe: probe["rate"])
        row["capacity_rps"] = max((p["rate"] for p in probes if p["passed"]), default=None)
    return row


def workload_cells(summary: dict) -> dict[str, Any]:
    """One workload's numbers for the per-workload table."""
    return {"ttft_p50_ms": summary["ttft_ms"]["p50"], "ttft_p99_ms": summary["ttft_ms"]["p99"],
            "tbt_p50_ms": summary["tbt_ms"]["p50"], "tbt_p99_ms": summary["tbt_ms"]["p99"],
            "e2e_p50_s": _ms_to_s(summary["e2e_ms"]["p50"]), "output_tok_s": summary["output_token_throughput"],
            "total_tok_s": summary["total_token_throughput"],
            "prefix_hit_pct": None if summary.get("prefix_cache_hit_rate") is None
            else 100 * summary["prefix_cache_hit_rate"]}


def probe_record(rate: float | str, summary: dict, spec: dict) -> dict[str, Any]:
    """One capacity probe: its rate, P99 TBT, median TTFT, and whether it met the spec."""
    return {"rate": float(rate), "tbt_p99_ms": summary["tbt_ms"]["p99"], "ttft_p50_ms": summary["ttft_ms"]["p50"],
            "passed": probe_passes(summary, spec)}


def probe_passes(summary: dict, spec: dict) -> bool:
    """Every request completed, P99 TBT within the SLO, median TTFT within its bound (if set)."""
    p99, ttft_p50 = summary["tbt_ms"]["p99"], summary["ttft_ms"]["p50"]
    max_ttft_s = spec.get("max_median_ttft_s")
    return (summary["failed"] == 0 and p99 is not None and p99 <= float(spec["slo_tbt_ms"])
            and (not max_ttft_s or (ttft_p50 is not None and ttft_p50 <= 1000.0 * float(max_ttft_s))))


SUMMARY_COLUMNS = [
    ("config", "config", "{}"),
    ("long_ttft_p50_s", "long-prompt TTFT p50 s", "{:.2f}"),
    ("short_ttft_p50_ms", "short-prompt TTFT p50 ms", "{:.0f}"),
    ("tbt_p50_ms", "decode TBT p50 ms", "{:.0f}"),
    ("tbt_p99_ms", "p99 ms", "{:.0f}"),
    ("tbt_max_ms", "max ms", "{:.0f}"),
    ("output_tok_s", "throughput out tok/s", "{:.1f}"),
    ("capacity_rps", "capacity req/s", "{:.2f}"),
]


def summary_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table: readable on the terminal, pasted as is into docs/BENCHMARKS.md or the log.
    A capacity below every probed rate reads "< lowest rate"."""
    body = []
    for row in rows:
        cells = [_fmt(row.get(key), fmt) for key, _, fmt in SUMMARY_COLUMNS]
        if row.get("capacity_rps") is None and row.get("capacity_probes"):
            cells[-1] = f"< {row['capacity_probes'][0]['rate']:.2f}"
        body.append(cells)
    lines = markdown_table([title for _, title, _ in SUMMARY_COLUMNS], body)
    failures = [f"- {row['config']}: {row['error']}" for row in rows if row.get("error")]
    if failures:
        lines += ["", "Failed configurations:", *failures]
    return "\n".join(lines)


WORKLOAD_COLUMNS = [
    ("ttft_p50_ms", "TTFT p50 ms", "{:.0f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.0f}"),
    ("tbt_p50_ms", "TBT p50 ms", "{:.0f}"),
    ("tbt_p99_ms", "TBT p99 ms", "{:.0f}"),
    ("e2e_p50_s", "E2E p50 s", "{:.2f}"),
    ("output_tok_s", "out tok/s", "{:.1f}"),
    ("total_tok_s", "total tok/s", "{:.0f}"),
    ("prefix_hit_pct", "prefix-cache hit %", "{:.1f}"),
]


def workload_table(rows: list[dict[str, Any]]) -> str:
    """Every workload of every configuration, one row each (Markdown)."""
    names = list(dict.fromkeys(name for row in rows for name in row.get("workloads", {})))
    body = [[name, row["config"], *(_fmt(row["workloads"][name][key], fmt) for key, _, fmt in WORKLOAD_COLUMNS)]
            for name in names for row in rows if name in row.get("workloads", {})]
    return "\n".join(markdown_table(["workload", "config"] + [title for _, title, _ in WORKLOAD_COLUMNS], body))


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """The lines of a Markdown table."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def capacity_table(rows: list[dict[str, Any]], spec: dict) -> str:
    """Every capacity probe: P99 TBT / median TTFT at each rate, the passing ones in bold."""
    rates = sorted({p["rate"] for row in rows for p in row.get("capacity_probes", [])})
    bound = f", median TTFT <= {spec['max_median_ttft_s']} s" if spec.get("max_median_ttft_s") else ""
    lines = [f"Capacity probes: P99 TBT ms / median TTFT s at each request rate (bold: meets P99 TBT <= "
             f"{spec['slo_tbt_ms']} ms{bound})", "",
             "| config | " + " | ".join(f"{r:.2f} req/s" for r in rates) + " |", "|---|" + "---|" * len(rates)]
    for row in rows:
        by_rate = {p["rate"]: p for p in row.get("capacity_probes", [])}
        cells = [_probe_cell(by_rate.get(rate)) for rate in rates]
        lines.append(f"| {row['config']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _probe_cell(probe: dict[str, Any] | None) -> str:
    if probe is None:
        return ""
    text = f"{_fmt(probe['tbt_p99_ms'])} / {_fmt(_ms_to_s(probe['ttft_p50_ms']), '{:.1f}')}"
    return f"**{text}**" if probe["passed"] else text


def _result_path(sweep: SweepConfig, config: ServerConfig, workload: str) -> str:
    return os.path.join(sweep.out_dir, f"{config.slug}.{workload}.json")


def _capacity_results(sweep: SweepConfig, config: ServerConfig) -> list[dict]:
    prefix = f"{config.slug}.capacity-"
    names = sorted(n for n in os.listdir(sweep.out_dir) if n.startswith(prefix)) if os.path.isdir(sweep.out_dir) else []
    return [_load(os.path.join(sweep.out_dir, name)) for name in names]


def _load(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _bench(base_url: str, config: ServerConfig, flags: list[str], label: str, result_file: str | None) -> dict:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    model = ["--model", config.model] if config.model else []
    target = ["--result-file", result_file] if result_file else []
    args = parser.parse_args(["--base-url", base_url, "--label", label, *model, *target, *flags])
    return bench_serve.run_benchmark(args)


def _capacity(base_url: str, config: ServerConfig, sweep: SweepConfig) -> float:
    return capacity_search(sweep, config, lambda flags, label, path: _bench(base_url, config, flags, label, path))


def capacity_search(sweep: SweepConfig, config: ServerConfig,
                    run_probe: Callable[[list[str], str, str | None], dict]) -> float:
    """Bisection over [min_rate, max_rate]; every probe's result is kept in out_dir.
    `run_probe(bench flags, label, result file)` runs one probe and returns its result (a real
    server's through `bench serve`, or `chunkserve sim --sweep`'s simulated one)."""
    spec = sweep.capacity
    low, high = float(spec["min_rate"]), float(spec["max_rate"])
    best = 0.0
    for probe in range(int(spec.get("probes", 4))):
        rate = high if probe == 0 else (low + high) / 2
        # A new seed per probe: servers with a prefix or prompt cache must not reuse an earlier probe's prompts.
        flags = [*spec["args"], "--request-rate", str(rate), "--seed", str(CAPACITY_SEED + probe)]
        result_file = os.path.join(sweep.out_dir, f"{config.slug}.capacity-{rate:.3f}.json") if sweep.out_dir else None
        summary = run_probe(flags, f"{config.label} @ {rate:.2f} req/s", result_file)["summary"]
        passed = probe_passes(summary, spec)
        log(f"{config.label}: capacity probe {rate:.2f} req/s: TBT p99 {_fmt(summary['tbt_ms']['p99'])} ms, "
            f"TTFT p50 {_fmt(summary['ttft_ms']['p50'])} ms -> {'pass' if passed else 'fail'}")
        if passed:
            best = max(best, rate)
            if probe == 0:
                break  # even the highest rate meets the SLO
            low = rate
        else:
            high = rate
    return best


def _server(sweep: SweepConfig, config: ServerConfig) -> Service:
    """The configuration's server process on the sweep's port (its log: `<slug>.server.log`)."""
    if config.command:
        command = list(config.command)  # {port} is substituted by Service
    else:
        trace = os.path.join(sweep.out_dir, f"{config.slug}.steps.jsonl")
        command = [sys.executable, "-m", "chunkserve.entrypoints.cli", "serve", "--trace-steps", trace,
                   *sweep.server_args, *config.args]
    return Service(command, os.path.join(sweep.out_dir, f"{config.slug}.server.log"), port=sweep.port,
                   add_port_flag=not config.command, log_mode="w", start_timeout_s=config.startup_timeout_s)


def _fmt(value: float | None, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def _ms_to_s(value: float | None) -> float | None:
    return None if value is None else value / 1000


def log(message: str) -> None:
    print(f"[sweep] {message}", file=sys.stderr, flush=True)

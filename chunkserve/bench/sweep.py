"""`chunkserve bench sweep --config sweep.yaml`: every server configuration through the same
workloads, one summary table.

For each configuration the sweep starts a server (ours, or any command that starts an
OpenAI-compatible server, e.g. a peer), waits for /health, runs the workloads with
`bench serve` in-process, searches the capacity, stops the server with SIGTERM, and keeps
every result file (and ours' step traces) in the output folder.

Capacity is Sarathi-Serve's metric: the highest request rate whose P99 TBT stays under
the SLO while the server keeps up. TBT alone cannot see overload (a request waiting in the
queue has no tokens yet), so, as Sarathi-Serve bounds the median scheduling delay, a probe
also fails when the median TTFT exceeds `max_median_ttft_s` (TTFT is the closest the client
sees: the queueing delay plus the prompt's own prefill). It is found by bisection over `[min_rate, max_rate]`: each probe runs the
capacity workload at one rate; `probes` probes narrow the interval, and the reported
capacity is the highest rate that passed (0 if none did). Each probe draws new prompts (its own
seed), so a server's prefix cache cannot make a later probe cheaper.

The config file (YAML):

    out_dir: bench-results/sweep           # results, traces, summary.md, summary.json
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
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from chunkserve.bench import serve as bench_serve

HEALTH_POLL_S = 0.5
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


def main(args: argparse.Namespace) -> None:
    sweep = SweepConfig.load(args.config)
    configs = [c for c in sweep.configs if not args.only or c.label in args.only]
    os.makedirs(sweep.out_dir, exist_ok=True)
    rows = [run_config_or_report(sweep, config) for config in configs]
    table = summary_table(rows)
    print(table)
    with open(os.path.join(sweep.out_dir, "summary.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(sweep.out_dir, "summary.json"), "w") as f:
        json.dump(rows, f, indent=2)


def run_config_or_report(sweep: SweepConfig, config: ServerConfig) -> dict[str, Any]:
    """``run_config``, or a row that says why it failed (a peer not installed, a server that
    crashed): one configuration's failure must not lose the others' results."""
    try:
        return run_config(sweep, config)
    except (OSError, RuntimeError, httpx.HTTPError) as error:
        log(f"{config.label}: FAILED: {type(error).__name__}: {error}")
        return {"config": config.label, "error": f"{type(error).__name__}: {error}"}


def run_config(sweep: SweepConfig, config: ServerConfig) -> dict[str, Any]:
    """Start the server, run every workload and the capacity search, stop it."""
    base_url = f"http://127.0.0.1:{sweep.port}"
    log(f"{config.label}: starting the server")
    with _server(sweep, config) as server:
        _wait_healthy(base_url, config.startup_timeout_s, server)
        results = {}
        for name, flags in sweep.workloads.items():
            log(f"{config.label}: workload {name}")
            results[name] = _bench(base_url, config, flags, f"{config.label}", os.path.join(
                sweep.out_dir, f"{config.slug}.{name}.json"))
        capacity = _capacity(base_url, config, sweep) if sweep.capacity else None
    return summary_row(config.label, results, capacity)


def summary_row(label: str, results: dict[str, dict], capacity: float | None) -> dict[str, Any]:
    """The table's numbers from one configuration's results (None where a workload is absent)."""
    row: dict[str, Any] = {"config": label, "capacity_rps": capacity}
    interference = next((r["interference"] for r in results.values() if r.get("interference")), None)
    if interference:
        row["long_ttft_p50_s"] = _ms_to_s(interference["long_ttft_ms"]["p50"])
        for stat in ("p50", "p99", "max"):
            row[f"tbt_{stat}_ms"] = interference["tbt_during_long_ms"][stat]
    throughput = next((r for r in results.values() if not r.get("interference")), None)
    if throughput:
        row["short_ttft_p50_ms"] = throughput["summary"]["ttft_ms"]["p50"]
        row["output_tok_s"] = throughput["summary"]["output_token_throughput"]
    return row


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
    """A Markdown table: readable on the terminal, pasted as is into docs/BENCHMARKS.md."""
    header = [title for _, title, _ in SUMMARY_COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [fmt.format(row[key]) if row.get(key) is not None else "-" for key, _, fmt in SUMMARY_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    failures = [f"- {row['config']}: {row['error']}" for row in rows if row.get("error")]
    if failures:
        lines += ["", "Failed configurations:", *failures]
    return "\n".join(lines)


def _bench(base_url: str, config: ServerConfig, flags: list[str], label: str, result_file: str | None) -> dict:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    model = ["--model", config.model] if config.model else []
    target = ["--result-file", result_file] if result_file else []
    args = parser.parse_args(["--base-url", base_url, "--label", label, *model, *target, *flags])
    return bench_serve.run_benchmark(args)


def _capacity(base_url: str, config: ServerConfig, sweep: SweepConfig) -> float:
    spec = sweep.capacity
    low, high, slo = float(spec["min_rate"]), float(spec["max_rate"]), float(spec["slo_tbt_ms"])
    max_ttft_ms = 1000.0 * float(spec["max_median_ttft_s"]) if spec.get("max_median_ttft_s") else None
    best = 0.0
    for probe in range(int(spec.get("probes", 4))):
        rate = high if probe == 0 else (low + high) / 2
        # A new seed per probe: servers with a prefix or prompt cache must not reuse an earlier probe's prompts.
        flags = [*spec["args"], "--request-rate", str(rate), "--seed", str(CAPACITY_SEED + probe)]
        result = _bench(base_url, config, flags, f"{config.label} @ {rate:.2f} req/s",
                        os.path.join(sweep.out_dir, f"{config.slug}.capacity-{rate:.2f}.json") if sweep.out_dir else None)
        summary = result["summary"]
        p99, ttft_p50 = summary["tbt_ms"]["p99"], summary["ttft_ms"]["p50"]
        passed = (summary["failed"] == 0 and p99 is not None and p99 <= slo
                  and (max_ttft_ms is None or ttft_p50 <= max_ttft_ms))
        log(f"{config.label}: capacity probe {rate:.2f} req/s: TBT p99 {_fmt(p99)} ms, TTFT p50 "
            f"{_fmt(ttft_p50)} ms -> {'pass' if passed else 'fail'}")
        if passed:
            best = max(best, rate)
            if probe == 0:
                break  # even the highest rate meets the SLO
            low = rate
        else:
            high = rate
    return best


class _server:
    """Context manager: the configuration's server process, stopped with SIGTERM on exit."""

    def __init__(self, sweep: SweepConfig, config: ServerConfig) -> None:
        if config.command:
            self.command = [part.replace("{port}", str(sweep.port)) for part in config.command]
        else:
            trace = os.path.join(sweep.out_dir, f"{config.slug}.steps.jsonl")
            if os.path.exists(trace):
                os.remove(trace)
            self.command = [sys.executable, "-m", "chunkserve.cli", "serve", "--port", str(sweep.port),
                            "--trace-steps", trace, *sweep.server_args, *config.args]
        self.log_path = os.path.join(sweep.out_dir, f"{config.slug}.server.log")

    def __enter__(self) -> _server:
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()


def _wait_healthy(base_url: str, timeout_s: float, server: _server) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"the server exited with {server.process.returncode}; see {server.log_path}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(HEALTH_POLL_S)
    raise RuntimeError(f"{base_url} did not become healthy within {timeout_s:.0f} s")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _ms_to_s(value: float | None) -> float | None:
    return None if value is None else value / 1000


def log(message: str) -> None:
    print(f"[sweep] {message}", file=sys.stderr, flush=True)

"""One stream's decode beside other work on the same cores: what a replica, a prefill/decode
pair or a test server sharing the host costs a chunkserve server.

A measured server (default flags, the default model) answers requests one at a time (decode-1:
64-token prompts, `--output-len` tokens each) in three cases:

  alone    nothing else runs;
  busy     beside a plain busy process (one thread spinning in Python) pinned to the last CPU;
  engine   beside a second chunkserve server of the same variant decoding 8 streams, fed by a
           `chunkserve bench serve` process that keeps 8 requests in flight.

Each case reports the decode-1 TBT p50 (client side). Variants are checkouts with an optional
environment and flags, given as `LABEL CHECKOUT [KEY=VALUE ...] [--flag value ...]`: the servers
run in that checkout with its PYTHONPATH and TORCH_EXTENSIONS_DIR (`CHECKOUT/.ext`), so a worktree of
the main branch gives the "before". Rounds alternate the variants' order; tables give medians.

`--sessions separate` (the default) starts the measured server, the neighbour server and the
busy process each in a session of its own, as services started apart are: Linux schedules
each session as an autogroup, and the groups share the CPUs fairly, whatever their thread
counts. `--sessions shared` keeps them in the benchmark's session, where they compete thread by
thread. `--autogroup-nice -10` raises every one of these groups (and the benchmark's own), so
the rest of a shared host's work does not compete with them while they are measured.

    flock /tmp/bench.lock .venv/bin/python -m benchmarks.engine.shared_host --rounds 2 --autogroup-nice -10 \\
        --variant "before /work/wt-base" --variant "after ." --out shared_host.json
    .venv/bin/python -m benchmarks.engine.shared_host --variant "after ." --dry-run    # the commands, nothing started
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from chunkserve.bench.host import machine
from chunkserve.bench.serve import add_arguments, run_benchmark
from chunkserve.bench.service import Service, serve_command, stop_process_group

CASES = ("alone", "busy", "engine")
NEIGHBOUR_STREAMS = 8
NEIGHBOUR_OUTPUT_LEN = 256
DECODE_PROMPT_LEN = 64
BUSY_LOOP = "while True: pass"
STREAMS_TIMEOUT_S = 120
POLL_S = 0.2
GENERATED = "chunkserve:generation_tokens_total"


@dataclass
class Variant:
    """A checkout to run, with the environment variables and server flags it gets."""

    label: str
    checkout: str
    env: dict[str, str] = field(default_factory=dict)
    flags: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str) -> Variant:
        label, checkout, *rest = shlex.split(text)
        env = dict(item.split("=", 1) for item in rest if "=" in item and not item.startswith("-"))
        flags = [item for item in rest if "=" not in item or item.startswith("-")]
        return cls(label, os.path.abspath(checkout), env, flags)

    def environment(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": self.checkout,
                "TORCH_EXTENSIONS_DIR": os.path.join(self.checkout, ".ext"), **self.env}


def decode_one_tbt_ms(url: str, args: argparse.Namespace, seed: int) -> float:
    """Decode-1 TBT p50 over `args.requests` requests sent one after another."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    bench = parser.parse_args([
        "--base-url", url, "--workload", "random", "--num-prompts", str(args.requests), "--max-concurrency", "1",
        "--input-len", str(DECODE_PROMPT_LEN), "--output-len", str(args.output_len), "--seed", str(seed)])
    summary = run_benchmark(bench)["summary"]
    if summary["failed"]:
        raise RuntimeError(f"{summary['failed']} decode-1 requests failed")
    return summary["tbt_ms"]["p50"]


def running_requests(service: Service) -> float:
    return service.metrics().get("chunkserve:num_requests_running", 0.0)


def start_variant(variant: Variant, log_path: str, args: argparse.Namespace) -> Service:
    separate = args.sessions == "separate"
    server = Service(serve_command(*variant.flags), log_path, env=variant.environment(), cwd=variant.checkout,
                     new_session=separate)
    if separate:
        set_autogroup_nice(server.popen.pid, args.autogroup_nice)
    return server


def set_autogroup_nice(pid: int | str, nice: int | None) -> None:
    """The nice of the scheduler autogroup (the session) of `pid`."""
    if nice is not None:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))


def start_neighbour(variant: Variant, log_path: str, args: argparse.Namespace) -> tuple[Service, subprocess.Popen]:
    """A second server of `variant`, decoding NEIGHBOUR_STREAMS streams once this returns."""
    neighbour = start_variant(variant, log_path, args)
    neighbour.wait_healthy()
    with open(log_path, "a") as log:
        load = subprocess.Popen(
            [sys.executable, "-m", "chunkserve.entrypoints.cli", "bench", "serve", "--base-url", neighbour.url,
             "--workload", "random", "--num-prompts", "100000", "--max-concurrency", str(NEIGHBOUR_STREAMS),
             "--input-len", str(DECODE_PROMPT_LEN), "--output-len", str(NEIGHBOUR_OUTPUT_LEN)],
            stdout=log, stderr=subprocess.STDOUT, process_group=0)
    deadline = time.monotonic() + STREAMS_TIMEOUT_S
    while running_requests(neighbour) < NEIGHBOUR_STREAMS:
        if time.monotonic() > deadline or load.poll() is not None:
            raise RuntimeError(f"the neighbour never ran {NEIGHBOUR_STREAMS} streams; see {log_path}")
        time.sleep(POLL_S)
    return neighbour, load


def measure_case(case: str, server: Service, variant: Variant, args: argparse.Namespace, seed: int,
                 log_path: str) -> dict[str, float]:
    """Decode-1 TBT p50 of `server` while `case`'s other work runs; beside an engine, also the
    neighbour's output tokens per second meanwhile (what it kept of its own speed)."""
    if case == "alone":
        return {"tbt_p50_ms": decode_one_tbt_ms(server.url, args, seed)}
    if case == "busy":
        last_cpu = str(max(os.sched_getaffinity(0)))
        separate = args.sessions == "separate"
        busy = subprocess.Popen(["taskset", "-c", last_cpu, sys.executable, "-c", BUSY_LOOP],
                                start_new_session=separate, process_group=None if separate else 0)
        if separate:
            set_autogroup_nice(busy.pid, args.autogroup_nice)
        try:
            return {"tbt_p50_ms": decode_one_tbt_ms(server.url, args, seed)}
        finally:
            stop_process_group(busy, grace_s=0)
    neighbour, load = start_neighbour(variant, log_path, args)
    try:
        tokens, start = neighbour.metrics().get(GENERATED, 0.0), time.monotonic()
        tbt = decode_one_tbt_ms(server.url, args, seed)
        rate = (neighbour.metrics().get(GENERATED, 0.0) - tokens) / (time.monotonic() - start)
        return {"tbt_p50_ms": tbt, "neighbour_tok_s": rate}
    finally:
        stop_process_group(load, grace_s=0)
        neighbour.stop()


def run_variant(variant: Variant, args: argparse.Namespace, round_index: int, workdir: str) -> dict[str, dict]:
    log_path = os.path.join(workdir, f"{variant.label}-{round_index}.log")
    server = start_variant(variant, log_path, args)
    try:
        server.wait_healthy()
        info = httpx.get(f"{server.url}/get_server_info", timeout=10).json()
        print(f"[{variant.label}] cpu threads: {info.get('cpu_threads', 'not reported')}", file=sys.stderr)
        decode_one_tbt_ms(server.url, argparse.Namespace(requests=1, output_len=8), seed=10_000)  # warm-up
        results = {}
        for case in args.cases:
            results[case] = measure_case(case, server, variant, args, seed=round_index, log_path=log_path)
            print(f"[{variant.label}] round {round_index} {case}: {results[case]}", file=sys.stderr, flush=True)
        return results
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", type=Variant.parse, required=True,
                        help='"LABEL CHECKOUT [KEY=VALUE ...] [--server-flag value ...]"')
    parser.add_argument("--cases", type=lambda text: text.split(","), default=list(CASES),
                        help=f"comma-separated, of {CASES}")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=3, help="decode-1 requests per case")
    parser.add_argument("--output-len", type=int, default=32, help="tokens per decode-1 request")
    parser.add_argument("--out", default=None, help="write every measurement as JSON here")
    parser.add_argument("--sessions", choices=("separate", "shared"), default="separate",
                        help="the servers and the busy process each in a session (autogroup) of its own, or all in "
                             "the benchmark's")
    parser.add_argument("--autogroup-nice", type=int, default=None,
                        help="nice of the benchmark's autogroups: -10 keeps the host's other work from taking the "
                             "cores while it measures")
    parser.add_argument("--dry-run", action="store_true",
                        help="print each variant's server command and environment; start nothing")
    args = parser.parse_args()
    if unknown := set(args.cases) - set(CASES):
        parser.error(f"unknown cases {sorted(unknown)}; known: {CASES}")
    if args.dry_run:
        for variant in args.variant:
            extra = {key: value for key, value in variant.environment().items() if os.environ.get(key) != value}
            print(f"{variant.label}: in {variant.checkout}, {extra}: {' '.join(serve_command(*variant.flags))}")
        print(f"cases {', '.join(args.cases)}; {args.rounds} rounds, {args.sessions} sessions")
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs the servers' clean-up
    set_autogroup_nice("self", args.autogroup_nice)
    rows = []
    with tempfile.TemporaryDirectory(prefix="shared_host-") as workdir:
        for round_index in range(args.rounds):
            order = args.variant if round_index % 2 == 0 else args.variant[::-1]
            for variant in order:
                for case, measured in run_variant(variant, args, round_index, workdir).items():
                    rows.append({"variant": variant.label, "case": case, "round": round_index, **measured})
    host = machine()
    print(f"\n{host['cpu']}, {host['cpus']} CPUs, commit {host['commit']}; decode-1 TBT p50 (ms), median of "
          f"{args.rounds} rounds (each round's value in brackets), {args.sessions} sessions; x = against alone")
    print(f"{'variant':<16}" + "".join(f"{case:>28}" for case in args.cases))
    for variant in args.variant:
        cells = []
        for case in args.cases:
            values = [r["tbt_p50_ms"] for r in rows if r["variant"] == variant.label and r["case"] == case]
            alone = [r["tbt_p50_ms"] for r in rows if r["variant"] == variant.label and r["case"] == "alone"]
            ratio = f" {statistics.median(values) / statistics.median(alone):.1f}x" if alone else ""
            cells.append(f"{statistics.median(values):.1f}{ratio} [{', '.join(f'{v:.0f}' for v in values)}]")
        rates = [r["neighbour_tok_s"] for r in rows if r["variant"] == variant.label and "neighbour_tok_s" in r]
        neighbour = f"   neighbour {statistics.median(rates):.0f} tok/s" if rates else ""
        print(f"{variant.label:<16}" + "".join(f"{cell:>28}" for cell in cells) + neighbour)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": host, "config": {k: v for k, v in vars(args).items() if k != "variant"},
                       "variants": [vars(v) for v in args.variant], "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""Prefill/decode disaggregation against long-prompt interference, on the same 2 cores.

The `interference` workload of `chunkserve bench serve` (decode streams sent at t=0, then long
prompts every few seconds) against three configurations:

  (a) colocated, 2 cores: one `chunkserve serve` pinned to cores 0-1, 2 threads;
  (b) colocated, 1 core: one server pinned to core 0, 1 thread;
  (c) disaggregated: a prefill instance on core 0 and a decode instance on core 1, 1 thread
      each, behind `chunkserve router --pd-disaggregation` (it does no compute) on core 1.

Every server runs under `taskset -c` with OMP_NUM_THREADS/MKL_NUM_THREADS set to its number of
cores and OMP_WAIT_POLICY=passive (chunkserve sets no thread count itself; an OpenMP team with
more threads than cores spins and slows every op). The colocated servers and the prefill
instance use `--max-num-batched-tokens 256`: Scenario B's budget in docs/BENCHMARKS.md, which
cuts a 2048-token prompt into 8 chunks so a colocated server's streams get a token between
chunks (the default 512 doubles the stall); the prefill instance gets the same chunks, and
pushes each chunk's KV as it is computed. The load generator (this process) runs on core 1 in
every configuration. In (c) core 1 thus carries the decode instance and all the HTTP work
(router, client) whether or not core 0 is computing a prompt: unpinned, the router and the
client would move to core 1 only while core 0 is busy, and the decode steps under prefill load
would pay for them.

Besides (a)-(c), each round runs (c) once more with the streams alone (no long prompts): the
decode instance's decode-only step time. Every server writes `--trace-steps` (in the workdir;
benchmarks/engine/sim_pd_accuracy.py fits simulator profiles on them); in (c) a decode
step that overlaps a prefill-instance step computing prompt tokens ran *under prefill load*,
the others *without*; only steps with exactly `--streams` decode rows and no prompt tokens are
compared (one batch shape). The instances' /metrics give the KV transfers
(`chunkserve:kv_transfer_*`): bytes and latency per transfer, for the streams' prompts (the
totals polled until the streams' transfers are done, before the first long prompt) and the long
prompts' (the rest of the run). The decode side's latency runs from its bootstrap to the last
block, the prefill side's from the first block sent to the final message: for a long prompt
both span most of its chunked prefill, so they are not the wire time.

Every configuration starts fresh servers and uses the same seed (the same prompts); rounds
alternate the order (a, b, c, streams-only, then back), and the tables give medians over rounds.

    .venv/bin/python -m benchmarks.engine.pd_interference --rounds 3 --out pd_interference.json
    # a short check of the script (one round, two 1024-token prompts; about 5 minutes):
    .venv/bin/python -m benchmarks.engine.pd_interference --rounds 1 --long-prompts 2 --long-len 1024 \\
        --long-every 4 --long-start 3 --stream-output-len 128
    .venv/bin/python -m benchmarks.engine.pd_interference --dry-run     # the processes and flags, nothing started
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from chunkserve.bench.host import machine
from chunkserve.bench.serve import add_arguments, run_benchmark
from chunkserve.bench.service import Service, free_port, serve_command

BUDGET_FLAGS = ["--max-num-batched-tokens", "256"]
CONFIGS = {"a": "(a) colocated, cores 0-1, 2 threads", "b": "(b) colocated, core 0, 1 thread",
           "c": "(c) prefill core 0 + decode core 1", "c0": "(c) streams only, no long prompts"}
TRANSFER_METRICS = ("chunkserve:kv_transfer_bytes_total", "chunkserve:kv_transfer_requests_total",
                    "chunkserve:kv_transfer_failed_total", "chunkserve:kv_transfer_latency_seconds_sum",
                    "chunkserve:kv_transfer_latency_seconds_count")


@dataclass
class Deployment:
    """The processes of one configuration; `entry` takes the workload; `prefill`/`decode` only in (c)."""

    processes: list[Service]
    entry: Service
    prefill: Service | None = None
    decode: Service | None = None
    prefill_trace: str | None = None
    decode_trace: str | None = None

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()


@dataclass
class Process:
    """One process of a configuration: its command (the harness adds --port), cores and threads."""

    role: str
    command: list[str]
    cpus: str
    threads: int
    port: int


def processes(config: str, args: argparse.Namespace, workdir: str, tag: str) -> list[Process]:
    """`config`'s processes in start order, on ports chosen now (the router is told its instances')."""
    kv = ["--kv-cache-memory-gb", str(args.kv_cache_memory_gb)]
    if config in ("a", "b"):
        cpus, threads = ("0-1", 2) if config == "a" else ("0", 1)
        server = serve_command(*kv, *BUDGET_FLAGS, "--trace-steps", server_trace(workdir, tag))
        return [Process("server", server, cpus, threads, free_port())]
    prefill_trace, decode_trace = traces(workdir, tag)
    bootstrap_port, prefill_port, decode_port = free_port(), free_port(), free_port()
    prefill = serve_command(*kv, *BUDGET_FLAGS, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                            str(bootstrap_port), "--trace-steps", prefill_trace)
    decode = serve_command(*kv, "--disaggregation-mode", "decode", "--trace-steps", decode_trace)
    router = [sys.executable, "-m", "chunkserve.entrypoints.cli", "router", "--pd-disaggregation",
              "--prefill", f"http://127.0.0.1:{prefill_port}", str(bootstrap_port),
              "--decode", f"http://127.0.0.1:{decode_port}", "--host", "127.0.0.1", "--log-level", "warning"]
    return [Process("prefill", prefill, "0", 1, prefill_port), Process("decode", decode, "1", 1, decode_port),
            Process("router", router, "1", 1, free_port())]


def server_trace(workdir: str, tag: str) -> str:
    return os.path.join(workdir, f"{tag}-server-steps.jsonl")


def traces(workdir: str, tag: str) -> tuple[str, str]:
    return os.path.join(workdir, f"{tag}-prefill-steps.jsonl"), os.path.join(workdir, f"{tag}-decode-steps.jsonl")


def deploy(config: str, args: argparse.Namespace, workdir: str, tag: str, running: list[Service]) -> Deployment:
    """Start `config`'s processes (each registered in `running` at once, for the cleanup) and
    wait until its entry point answers /health (the router answers 503 until it has seen both
    instances healthy)."""
    log = os.path.join(workdir, f"{tag}.log")
    started: dict[str, Service] = {}
    for process in processes(config, args, workdir, tag):
        if process.role == "router":  # after its instances are up
            started["prefill"].wait_healthy()
            started["decode"].wait_healthy()
        env = {**os.environ, "OMP_NUM_THREADS": str(process.threads), "MKL_NUM_THREADS": str(process.threads),
               "OMP_WAIT_POLICY": "passive"}
        service = Service(process.command, log, process.cpus, env, port=process.port)
        running.append(service)
        started[process.role] = service
    if "server" in started:
        started["server"].wait_healthy()
        return Deployment([started["server"]], started["server"])
    started["router"].wait_healthy()
    prefill_trace, decode_trace = traces(workdir, tag)
    return Deployment([started["prefill"], started["decode"], started["router"]], started["router"],
                      started["prefill"], started["decode"], prefill_trace, decode_trace)


def dry_run(configs: list[str], args: argparse.Namespace) -> None:
    """Each configuration's processes and the workload's flags (parsed), without starting anything."""
    for config in configs:
        print(f"{CONFIGS[config]}:")
        for process in processes(config, args, "WORKDIR", "TAG"):
            print(f"  {process.role} (cores {process.cpus}, {process.threads} thread(s)): {' '.join(process.command)} "
                  f"--port {process.port}")
        bench = bench_args("http://127.0.0.1:1", args, 0 if config == "c0" else args.long_prompts)
        print(f"  workload: {bench.workload}, {bench.streams} streams, {bench.long_prompts} long prompts")


def bench_args(url: str, args: argparse.Namespace, long_prompts: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([
        "--base-url", url, "--workload", "interference", "--seed", str(args.seed), "--streams", str(args.streams),
        "--stream-input-len", str(args.stream_input_len), "--stream-output-len", str(args.stream_output_len),
        "--long-prompts", str(long_prompts), "--long-len", str(args.long_len), "--long-every", str(args.long_every),
        "--long-start", str(args.long_start), "--long-output-len", str(args.long_output_len)])


def read_trace(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def stats_ms(seconds: Iterable[float]) -> dict:
    values = np.asarray(list(seconds), dtype=float) * 1000
    if values.size == 0:
        return {"count": 0, "p50": None, "p99": None, "max": None}
    return {"count": int(values.size), "p50": float(np.percentile(values, 50)),
            "p99": float(np.percentile(values, 99)), "max": float(values.max())}


def decode_steps(decode_trace: list[dict], prefill_trace: list[dict], streams: int) -> dict:
    """The decode instance's step durations, split by whether the step overlapped a prefill
    instance step that computed prompt tokens; `rows_<streams>` only the steps with exactly that
    many decode rows and no prompt tokens, `all` every step that decoded."""
    busy = [(s["start_time"], s["start_time"] + s["duration_s"]) for s in prefill_trace if s["num_prefill_tokens"]]

    def loaded(step: dict) -> bool:
        start, end = step["start_time"], step["start_time"] + step["duration_s"]
        return any(b_start < end and start < b_end for b_start, b_end in busy)

    result = {}
    for key, keep in ((f"rows_{streams}", lambda s: s["num_decode_tokens"] == streams and not s["num_prefill_tokens"]),
                      ("all", lambda s: s["num_decode_tokens"] > 0)):
        steps = [s for s in decode_trace if keep(s)]
        result[key] = {"with_prefill_load": stats_ms(s["duration_s"] for s in steps if loaded(s)),
                       "without_prefill_load": stats_ms(s["duration_s"] for s in steps if not loaded(s))}
    return result


class StreamTransfers(threading.Thread):
    """Polls the (c) instances' /metrics while the workload runs and keeps their totals from the
    moment the streams' `count` transfers had finished on both and nothing else yet: what the
    run adds after that is the long prompts'. (Polling stops there, before the first long prompt.)"""

    def __init__(self, instances: dict[str, Service], count: int) -> None:
        super().__init__(daemon=True)
        self.instances = instances
        self.count = count
        self.totals: dict[str, dict[str, float]] | None = None
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            totals = {role: service.metrics() for role, service in self.instances.items()}
            finished = [t.get("chunkserve:kv_transfer_requests_total", 0.0)
                        + t.get("chunkserve:kv_transfer_failed_total", 0.0) for t in totals.values()]
            if min(finished) >= self.count:
                self.totals = totals if max(finished) == self.count else None
                return
            self.stop_event.wait(0.25)


def totals_between(after: dict[str, dict[str, float]], before: dict[str, dict[str, float]]) -> dict:
    """Per instance: what the kv_transfer totals grew by."""
    return {role: {name.removeprefix("chunkserve:"): after[role].get(name, 0.0) - before[role].get(name, 0.0)
                   for name in TRANSFER_METRICS} for role in after}


def run_config(config: str, args: argparse.Namespace, workdir: str, round_index: int,
               running: list[Service]) -> dict:
    tag = f"round{round_index + 1}-{config}"
    deployment = deploy(config, args, workdir, tag, running)
    instances = {"prefill": deployment.prefill, "decode": deployment.decode} if deployment.prefill else {}
    streams = StreamTransfers(instances, args.streams)
    try:
        before = {role: service.metrics() for role, service in instances.items()}
        if instances:
            streams.start()
        print(f"round {round_index + 1}: {CONFIGS[config]}", file=sys.stderr)
        load_before = os.getloadavg()[0]
        result = run_benchmark(bench_args(deployment.entry.url, args, 0 if config == "c0" else args.long_prompts))
        load_after = os.getloadavg()[0]
        time.sleep(1.0)  # the last steps' stats reach /metrics
        after = {role: service.metrics() for role, service in instances.items()}
    finally:
        streams.stop_event.set()
        deployment.stop()
        for process in deployment.processes:
            running.remove(process)
    row: dict = {"config": config, "bench": result, "loadavg_1min": [load_before, load_after]}
    if instances:
        row["transfers"] = {"run": totals_between(after, before),
                            "streams": totals_between(streams.totals, before) if streams.totals else None,
                            "long_prompts": totals_between(after, streams.totals) if streams.totals else None}
        row["decode_steps"] = decode_steps(read_trace(deployment.decode_trace), read_trace(deployment.prefill_trace),
                                           args.streams)
        row["traces"] = {"prefill": deployment.prefill_trace, "decode": deployment.decode_trace}
    else:
        row["traces"] = {"server": server_trace(workdir, tag)}
    return row


def derived(rows: dict[str, dict], streams: int) -> dict[str, dict[str, float | None]]:
    """One round's numbers per configuration, flat (the tables take medians of these)."""
    out: dict[str, dict[str, float | None]] = {}
    for config, row in rows.items():
        summary, interference = row["bench"]["summary"], row["bench"]["interference"]
        tbt = interference["tbt_during_long_ms"] if config != "c0" else interference["stream_tbt_ms"]
        ttft = interference["long_ttft_ms"]
        out[config] = {
            "tbt_p50_ms": tbt["p50"], "tbt_p99_ms": tbt["p99"], "tbt_max_ms": tbt["max"], "tbt_count": tbt["count"],
            "long_ttft_p50_s": ttft["p50"] / 1000 if ttft["p50"] is not None else None,
            "long_ttft_p99_s": ttft["p99"] / 1000 if ttft["p99"] is not None else None,
            "output_tok_s": summary["output_token_throughput"], "duration_s": summary["duration_s"],
            "failed": summary["failed"], "load": row["loadavg_1min"][1],
        }
    if "c" in rows and "c0" in rows:
        steps = rows["c"]["decode_steps"][f"rows_{streams}"]
        base = rows["c0"]["decode_steps"][f"rows_{streams}"]["without_prefill_load"]
        for label, stats in (("baseline", base), ("idle", steps["without_prefill_load"]),
                             ("busy", steps["with_prefill_load"])):
            for key in ("count", "p50", "p99", "max"):
                out["c"][f"step_{label}_{key}"] = stats[key]
        for label, other in (("busy_vs_idle", "idle"), ("busy_vs_baseline", "baseline"),
                             ("idle_vs_baseline", "baseline")):
            first = label.split("_vs_")[0]
            for key in ("p50", "p99"):
                out["c"][f"step_ratio_{label}_{key}"] = ratio(out["c"][f"step_{first}_{key}"],
                                                              out["c"][f"step_{other}_{key}"])
        for role in ("prefill", "decode"):
            for part, totals in rows["c"]["transfers"].items():
                per = per_transfer(totals[role] if totals else None)
                for key, value in per.items():
                    out["c"][f"{role}_{part}_{key}"] = value
    return out


def per_transfer(totals: dict[str, float] | None) -> dict[str, float | None]:
    """Transfers, failures, MB and ms per finished transfer (None where none finished)."""
    if totals is None:
        return {"transfers": None, "failed": None, "mb": None, "ms": None}
    n, timed = totals["kv_transfer_requests_total"], totals["kv_transfer_latency_seconds_count"]
    return {"transfers": n, "failed": totals["kv_transfer_failed_total"],
            "mb": totals["kv_transfer_bytes_total"] / n / 1e6 if n else None,
            "ms": 1000 * totals["kv_transfer_latency_seconds_sum"] / timed if timed else None}


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def cell(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n{title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def print_tables(medians: dict[str, dict[str, float | None]], per_round: list[dict],
                 args: argparse.Namespace) -> None:
    n = f"medians of {len(per_round)} round(s)"
    table(f"Stream TBT during the long prompts, ms ({n}; the streams-only row: its whole run)",
          ["config", "p50", "p99", "max", "gaps"],
          [[CONFIGS[c], cell(m["tbt_p50_ms"], 0), cell(m["tbt_p99_ms"], 0), cell(m["tbt_max_ms"], 0),
            cell(m["tbt_count"], 0)] for c, m in medians.items()])
    if "c" in medians:
        mine, alone = medians["c"], medians["c0"]
        print(f"\n(c) stream TBT during the long prompts / its streams-only run: "
              f"p50 {cell(ratio(mine['tbt_p50_ms'], alone['tbt_p50_ms']), 2)}x, "
              f"p99 {cell(ratio(mine['tbt_p99_ms'], alone['tbt_p99_ms']), 2)}x")
    table(f"Long-prompt TTFT, s ({n})", ["config", "p50", "p99"],
          [[CONFIGS[c], cell(m["long_ttft_p50_s"], 2), cell(m["long_ttft_p99_s"], 2)]
           for c, m in medians.items() if c != "c0"])
    for other in ("a", "b"):
        if "c" in medians and other in medians:
            mine, theirs = medians["c"], medians[other]
            print(f"\nlong-prompt TTFT, (c) / {CONFIGS[other]}: "
                  f"p50 {cell(ratio(mine['long_ttft_p50_s'], theirs['long_ttft_p50_s']), 2)}x, "
                  f"p99 {cell(ratio(mine['long_ttft_p99_s'], theirs['long_ttft_p99_s']), 2)}x")
    table(f"Output tokens/s over the run ({n}; the host's 1-minute load average at the run's end)",
          ["config", "output tok/s", "duration s", "failed requests", "host load"],
          [[CONFIGS[c], cell(m["output_tok_s"]), cell(m["duration_s"]), cell(m["failed"], 0), cell(m["load"])]
           for c, m in medians.items()])
    c = medians.get("c")
    if c is None:
        return
    parts = (("run", "all"), ("streams", f"streams' {args.stream_input_len}-token prompts"),
             ("long_prompts", f"{args.long_len}-token prompts"))
    table(f"KV transfers in (c) ({n}; latency: decode side from bootstrap to the last block, prefill side from "
          "the first block sent to the final message)",
          ["instance", "prompts", "transfers", "failed", "MB per transfer", "ms per transfer"],
          [[role, label, cell(c[f"{role}_{part}_transfers"], 0), cell(c[f"{role}_{part}_failed"], 0),
            cell(c[f"{role}_{part}_mb"]), cell(c[f"{role}_{part}_ms"], 0)]
           for role in ("prefill", "decode") for part, label in parts])
    table(f"Decode instance step durations in (c), steps of {args.streams} decode rows, ms ({n})",
          ["window", "steps", "p50", "p99", "max", "p50 / streams-only", "p99 / streams-only"],
          [[label, cell(c[f"step_{key}_count"], 0), cell(c[f"step_{key}_p50"]), cell(c[f"step_{key}_p99"]),
            cell(c[f"step_{key}_max"]), cell(ratio_of(c, key, "p50"), 3), cell(ratio_of(c, key, "p99"), 3)]
           for key, label in (("baseline", "streams-only run"), ("idle", "run (c), prefill instance idle"),
                              ("busy", "run (c), prefill instance computing prompts"))])
    ratios = [r["c"].get("step_ratio_busy_vs_idle_p50") for r in per_round if "c" in r]
    noise = [r["c"].get("step_ratio_idle_vs_baseline_p50") for r in per_round if "c" in r]
    print(f"\nbusy / idle in the same run (median): p50 {cell(c['step_ratio_busy_vs_idle_p50'], 3)}, "
          f"p99 {cell(c['step_ratio_busy_vs_idle_p99'], 3)}; per round p50: "
          f"{', '.join(cell(r, 3) for r in ratios)}")
    print(f"host noise, two loads without prefill (idle windows / streams-only run, p50) per round: "
          f"{', '.join(cell(r, 3) for r in noise)}")


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratio_of(c: dict, key: str, stat: str) -> float | None:
    return 1.0 if key == "baseline" else c.get(f"step_ratio_{key}_vs_baseline_{stat}")


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    """The arguments, and the configurations to run (c brings its streams-only run, c0)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--configs", default="a,b,c",
                        help="which of a, b, c to run (c includes its streams-only run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--stream-input-len", type=int, default=64)
    parser.add_argument("--stream-output-len", type=int, default=1280,
                        help="long enough for the streams to outlast the long prompts in every configuration")
    parser.add_argument("--long-prompts", type=int, default=6)
    parser.add_argument("--long-len", type=int, default=2048)
    parser.add_argument("--long-every", type=float, default=8.0, help="seconds between long prompts")
    parser.add_argument("--long-start", type=float, default=4.0,
                        help="seconds from the streams to the first long prompt")
    parser.add_argument("--long-output-len", type=int, default=16)
    parser.add_argument("--kv-cache-memory-gb", type=float, default=2.0,
                        help="each server's KV pool: room for every stream and a few long prompts at once")
    parser.add_argument("--workdir", default=None, help="servers' logs and step traces (default: a temp dir)")
    parser.add_argument("--out", default=None, help="the JSON with everything (default: results.json in the workdir)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print each configuration's processes and check the workload's flags; start nothing")
    args = parser.parse_args()
    configs = [c.strip() for c in args.configs.split(",")]
    if set(configs) - {"a", "b", "c"} or not configs:
        parser.error(f"--configs takes a comma-separated subset of a,b,c, got {args.configs!r}")
    if "c" in configs:
        configs.append("c0")
    return args, configs


def print_setup(host: dict, workdir: str, args: argparse.Namespace) -> None:
    avx512 = f"yes ({host['avx512_flags']})" if host["avx512"] else "no"
    print(f"CPU: {host['cpu']}, {host['cpus']} cores, AVX-512: {avx512}; commit {host['commit']}; "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"(c) front: chunkserve router, on core 1 with the load generator; logs and traces in {workdir}")
    print(f"workload: {args.streams} streams ({args.stream_input_len} -> {args.stream_output_len} tokens) at t=0, "
          f"{args.long_prompts} prompts of {args.long_len} tokens ({args.long_output_len} out) "
          f"every {args.long_every:g} s from t={args.long_start:g} s; seed {args.seed}", flush=True)


def run_rounds(configs: list[str], args: argparse.Namespace, workdir: str) -> tuple[list[dict], list[dict]]:
    """Every configuration once per round, their order reversed every other round; returns each
    round's derived figures and its raw rows. Every process started is stopped, whatever happens."""
    running: list[Service] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs the finally below
    per_round: list[dict] = []
    raw: list[dict] = []
    try:
        for round_index in range(args.rounds):
            order = configs if round_index % 2 == 0 else list(reversed(configs))
            rows = {config: run_config(config, args, workdir, round_index, running) for config in order}
            raw.append(rows)
            per_round.append(derived(rows, args.streams))
    finally:
        for process in reversed(running):
            process.stop()
    return per_round, raw


def main() -> None:
    args, configs = parse_args()
    if args.dry_run:
        dry_run(configs, args)
        return
    if (os.cpu_count() or 0) < 2:
        sys.exit("this benchmark pins processes to cores 0 and 1: it needs 2 cores")
    workdir = args.workdir or tempfile.mkdtemp(prefix="pd-interference-")
    os.makedirs(workdir, exist_ok=True)
    out_path = args.out or os.path.join(workdir, "results.json")
    host = machine()
    print_setup(host, workdir, args)

    os.sched_setaffinity(0, {1})  # the load generator: the client runs on this thread (later threads inherit it)
    per_round, raw = run_rounds(configs, args, workdir)
    present = [c for c in CONFIGS if c in configs]
    medians = {c: {key: median([r[c][key] for r in per_round]) for key in per_round[0][c]} for c in present}
    print_tables(medians, per_round, args)
    with open(out_path, "w") as f:
        json.dump({"machine": host, "args": vars(args), "medians": medians, "per_round": per_round, "runs": raw},
                  f, indent=1)
    print(f"\nwritten to {out_path}")


if __name__ == "__main__":
    main()

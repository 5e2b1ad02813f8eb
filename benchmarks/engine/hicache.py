"""The disk KV tier (issue 22): is reading history's KV back from disk better than computing it
again, and does the tier's I/O stall the requests that are decoding?

Part 1 runs the `multi-turn` and `prefix` workloads of `chunkserve bench serve` against a
server whose KV pool is too small to keep the history between turns, with the tier off, with
`write_back` (blocks are stored when the pool evicts them) and with `write_through` (stored as
they are computed), alternating the three in each round. Per configuration (medians over the
rounds): TTFT p50/p99 per turn, prompt tokens served by the pool and by the tier, output
tokens/s and decode TBT p99.

Part 3 (preemption): a burst of long requests on the same small pool preempts some of them;
a preempted request's full blocks are on disk with the tier (stored as computed, or as the pool
evicts them), so it loads them back instead of computing them again: tier off against
write_through, the preemptions and the tokens served from the tier, throughput and latency.

Part 2 (restart): a long chat turn on a server with the tier, the server stopped (SIGTERM) and
started again on the same folder, then the next turn: its TTFT and cached tokens against the
same turn on a cold server (no tier), and whether the two outputs are identical.

    .venv/bin/python -m benchmarks.engine.hicache --rounds 2
    .venv/bin/python -m benchmarks.engine.hicache --rounds 1 --only restart
    .venv/bin/python -m benchmarks.engine.hicache --rounds 2 --only preemption
    .venv/bin/python -m benchmarks.engine.hicache --dry-run     # the servers and workloads, no server
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import httpx
import numpy as np

from chunkserve.bench.serve import add_arguments, run_benchmark
from chunkserve.bench.service import Service

POOL_BLOCKS = "160"  # 2,560 tokens: a few chats' history; the rest is evicted between turns
SERVER_FLAGS = ["--num-kv-blocks", POOL_BLOCKS, "--max-num-batched-tokens", "256"]
CONFIGS = {
    "tier off": [],
    "write_back": ["--enable-hierarchical-cache", "--hicache-write-policy", "write_back"],
    "write_through": ["--enable-hierarchical-cache", "--hicache-write-policy", "write_through"],
}
TURNS = 4
WORKLOADS = {
    # 8 chats starting 1 per second, 4 turns each 1 s after the last answer: a shared 512-token system
    # prompt, 64-token user messages and replies; every turn resends the whole history.
    "multi-turn": ["--workload", "multi-turn", "--num-prompts", "8", "--turns", str(TURNS), "--prefix-len", "512",
                   "--input-len", "64", "--output-len", "64", "--think-time", "1", "--request-rate", "1"],
    # 32 requests, 1 per second, over 8 different 1024-token prefixes in turn, each its own 64-token suffix.
    "prefix": ["--workload", "prefix", "--num-prompts", "32", "--num-prefixes", "8", "--prefix-len", "1024",
               "--input-len", "64", "--output-len", "32", "--request-rate", "1"],
}
RESTART_PROMPT_LEN = 2000
# 12 requests at once, 512-token prompts, 256 output tokens: 48 blocks each, 576 in all, on 160
PREEMPTION_WORKLOAD = ["--workload", "random", "--num-prompts", "12", "--input-len", "512", "--output-len", "256"]
STOP_GRACE_S = 120


def start_chunkserve(flags: list[str], log_path: str) -> Service:
    """`chunkserve serve` with `flags`, healthy (stop it with `stop_chunkserve`)."""
    server = Service([sys.executable, "-m", "chunkserve.entrypoints.cli", "serve", *flags], log_path)
    try:
        server.wait_healthy()
    except RuntimeError:
        stop_chunkserve(server)
        raise
    return server


def stop_chunkserve(server: Service) -> None:
    """SIGTERM (a write_back tier flushes the pool's cached blocks on the way out), SIGKILL after 2 minutes."""
    server.stop(grace_s=STOP_GRACE_S)


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def run_workload(server: Service, name: str, seed: int) -> dict:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--base-url", server.url, *WORKLOADS[name], "--seed", str(seed)])
    before = server.metrics()
    result = run_benchmark(args)
    after = server.metrics()
    requests = result["requests"]
    prompt_tokens = sum(r["prompt_len"] for r in requests if r["ok"])
    ttfts = [(i, 1000 * (r["token_times"][0] - r["send_time"])) for i, r in enumerate(requests) if r["token_times"]]
    turns = TURNS if name == "multi-turn" else 1
    row = {
        "pool_hit_pct": 100 * delta(after, before, "chunkserve:prefix_cache_hits_total") / prompt_tokens,
        "tier_hit_pct": 100 * delta(after, before, "chunkserve:hicache_hit_tokens_total") / prompt_tokens,
        "output_tok_s": result["summary"]["output_token_throughput"],
        "tbt_p99_ms": result["summary"]["tbt_ms"]["p99"],
        "tier_load_mb": delta(after, before, "chunkserve:hicache_load_bytes_total") / 1e6,
        "tier_store_mb": delta(after, before, "chunkserve:hicache_store_bytes_total") / 1e6,
        "failed": result["summary"]["failed"],
    }
    for turn in range(turns):
        values = [t for i, t in ttfts if i % turns == turn]
        label = f"turn {turn + 1}" if turns > 1 else "all"
        row[f"ttft_p50_ms {label}"] = float(np.percentile(values, 50))
        row[f"ttft_p99_ms {label}"] = float(np.percentile(values, 99))
    return row


def part_workloads(rounds: int, workdir: str, log_path: str) -> dict:
    rows: dict[tuple[str, str], list[dict]] = {}
    for round_index in range(rounds):
        order = list(CONFIGS) if round_index % 2 == 0 else list(reversed(CONFIGS))
        for label in order:
            tier_dir = tempfile.mkdtemp(dir=workdir, prefix="tier-")
            flags = [*SERVER_FLAGS, *CONFIGS[label]]
            if CONFIGS[label]:
                flags += ["--hicache-storage-dir", tier_dir]
            server = start_chunkserve(flags, log_path)
            try:
                for workload in WORKLOADS:  # the same prompts in every round and configuration
                    print(f"round {round_index + 1}: {label}, {workload}", file=sys.stderr)
                    rows.setdefault((label, workload), []).append(run_workload(server, workload, seed=7))
            finally:
                stop_chunkserve(server)
                shutil.rmtree(tier_dir, ignore_errors=True)
    return {key: {column: statistics.median(r[column] for r in values) for column in values[0]}
            for key, values in rows.items()}


def part_preemption(rounds: int, workdir: str, log_path: str) -> dict[str, dict]:
    rows: dict[str, list[dict]] = {}
    configs = {"tier off": [], "write_through": CONFIGS["write_through"]}
    for round_index in range(rounds):
        for label in configs if round_index % 2 == 0 else list(reversed(configs)):
            tier_dir = tempfile.mkdtemp(dir=workdir, prefix="preempt-")
            flags = [*SERVER_FLAGS, *configs[label]] + (["--hicache-storage-dir", tier_dir] if configs[label] else [])
            server = start_chunkserve(flags, log_path)
            try:
                print(f"round {round_index + 1}: {label}, preemption", file=sys.stderr)
                parser = argparse.ArgumentParser()
                add_arguments(parser)
                before = server.metrics()
                result = run_benchmark(parser.parse_args(["--base-url", server.url, *PREEMPTION_WORKLOAD,
                                                          "--seed", "3"]))
                after = server.metrics()
            finally:
                stop_chunkserve(server)
                shutil.rmtree(tier_dir, ignore_errors=True)
            summary = result["summary"]
            rows.setdefault(label, []).append({
                "preemptions": delta(after, before, "chunkserve:num_preemptions_total"),
                "tier_hit_tokens": delta(after, before, "chunkserve:hicache_hit_tokens_total"),
                "pool_hit_tokens": delta(after, before, "chunkserve:prefix_cache_hits_total"),
                "output_tok_s": summary["output_token_throughput"],
                "e2e_p50_s": summary["e2e_ms"]["p50"] / 1000, "e2e_p99_s": summary["e2e_ms"]["p99"] / 1000,
                "tbt_p99_ms": summary["tbt_ms"]["p99"], "failed": summary["failed"],
            })
    return {label: {c: statistics.median(r[c] for r in values) for c in values[0]} for label, values in rows.items()}


def generate(url: str, input_ids: list[int], max_new_tokens: int) -> dict:
    """Streamed /generate: the first event's arrival (TTFT) and the final event."""
    body = {"input_ids": input_ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
    start, first, last = time.perf_counter(), None, None
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                first = first or time.perf_counter() - start
                last = json.loads(line[len("data: "):])
    return {"ttft_ms": 1000 * first, "output_ids": last["output_ids"],
            "cached_tokens": last["meta_info"]["cached_tokens"]}


def part_restart(rounds: int, workdir: str, log_path: str) -> list[dict]:
    rng = np.random.default_rng(11)
    results = []
    for _ in range(rounds):
        first_turn = rng.integers(100, 49052, RESTART_PROMPT_LEN).tolist()
        tier_dir = tempfile.mkdtemp(dir=workdir, prefix="restart-")
        flags = [*SERVER_FLAGS, "--enable-hierarchical-cache",
                 "--hicache-write-policy", "write_through", "--hicache-storage-dir", tier_dir]
        server = start_chunkserve(flags, log_path)
        try:
            answer = generate(server.url, first_turn, 32)["output_ids"]
        finally:
            stop_chunkserve(server)
        second_turn = first_turn + answer + rng.integers(100, 49052, 64).tolist()
        server = start_chunkserve(flags, log_path)  # the same folder: a restarted server
        try:
            warm = generate(server.url, second_turn, 32)
        finally:
            stop_chunkserve(server)
        server = start_chunkserve(SERVER_FLAGS, log_path)  # cold: no tier
        try:
            cold = generate(server.url, second_turn, 32)
        finally:
            stop_chunkserve(server)
        shutil.rmtree(tier_dir, ignore_errors=True)
        results.append({"prompt_tokens": len(second_turn), "warm_ttft_ms": warm["ttft_ms"],
                        "warm_cached_tokens": warm["cached_tokens"], "cold_ttft_ms": cold["ttft_ms"],
                        "cold_cached_tokens": cold["cached_tokens"],
                        "identical_output": warm["output_ids"] == cold["output_ids"]})
    return results


def dry_run() -> None:
    """What a run starts and sends: every configuration's server flags, every workload's bench flags (parsed)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for label, flags in CONFIGS.items():
        extra = ["--hicache-storage-dir", "TIER_DIR"] if flags else []
        print(f"{label}: chunkserve serve {' '.join([*SERVER_FLAGS, *flags, *extra])}")
    for name, flags in {**WORKLOADS, "preemption": PREEMPTION_WORKLOAD}.items():
        parser.parse_args(["--base-url", "http://127.0.0.1:1", *flags])
        print(f"workload {name}: bench serve {' '.join(flags)}")
    print(f"restart: a {RESTART_PROMPT_LEN}-token chat turn, the server restarted on its tier folder, the next turn")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", choices=("workloads", "restart", "preemption"), default=None)
    parser.add_argument("--workdir", default=None, help="tier folders and the servers' log (default: a temp dir)")
    parser.add_argument("--result-file", default=None)
    parser.add_argument("--dry-run", action="store_true",
                        help="print the servers' flags and check the workloads' flags; start no server")
    args = parser.parse_args()
    if args.dry_run:
        dry_run()
        return
    workdir = args.workdir or tempfile.mkdtemp(prefix="hicache-bench-")
    os.makedirs(workdir, exist_ok=True)
    log_path = os.path.join(workdir, "servers.log")
    output: dict = {}
    if args.only in (None, "workloads"):
        table = part_workloads(args.rounds, workdir, log_path)
        output["workloads"] = {f"{label} | {workload}": row for (label, workload), row in table.items()}
        for workload in WORKLOADS:
            columns = list(next(iter(r for (_, w), r in table.items() if w == workload)))
            print(f"\n{workload} (medians of {args.rounds} round(s); pool {POOL_BLOCKS} blocks)")
            print("| config | " + " | ".join(columns) + " |")
            print("|---|" + "---|" * len(columns))
            for label in CONFIGS:
                row = table[(label, workload)]
                print(f"| {label} | " + " | ".join(f"{row[c]:.1f}" for c in columns) + " |")
    if args.only in (None, "restart"):
        restarts = part_restart(args.rounds, workdir, log_path)
        output["restart"] = restarts
        print("\nrestart: the next turn of a 2,000-token chat after the server restarted on its tier folder")
        print("| prompt tokens | restarted: TTFT ms | cached | cold: TTFT ms | cached | identical output |")
        print("|---|---|---|---|---|---|")
        for r in restarts:
            print(f"| {r['prompt_tokens']} | {r['warm_ttft_ms']:.0f} | {r['warm_cached_tokens']} | "
                  f"{r['cold_ttft_ms']:.0f} | {r['cold_cached_tokens']} | {r['identical_output']} |")
    if args.only in (None, "preemption"):
        table = part_preemption(args.rounds, workdir, log_path)
        output["preemption"] = table
        columns = list(next(iter(table.values())))
        print(f"\npreemption: {' '.join(PREEMPTION_WORKLOAD)} on {POOL_BLOCKS} blocks (medians of {args.rounds})")
        print("| config | " + " | ".join(columns) + " |")
        print("|---|" + "---|" * len(columns))
        for label, row in table.items():
            print(f"| {label} | " + " | ".join(f"{row[c]:.1f}" for c in columns) + " |")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(output, f, indent=1)


if __name__ == "__main__":
    main()

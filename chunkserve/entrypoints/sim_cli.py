"""`chunkserve sim`: the real scheduler on a simulated clock; `chunkserve profile`: the step-time
profile it runs on. Both take `chunkserve serve`'s engine flags, so a simulated configuration
is written as the server would be started.

    chunkserve profile steps.jsonl -o profile.json             # from any --trace-steps file
    chunkserve profile -o profile.json                         # or by timing synthetic steps here
    chunkserve sim --profile profile.json --workload sharegpt-like --request-rate 2 --max-num-batched-tokens 512
    chunkserve sim --profile profile.json --trace requests.jsonl --replicas 4 --router prefix
    chunkserve sim --profile profile.json --workload interference --pd 1:1   # a prefill and a decode instance
    chunkserve sim --profile profile.json --from-log server.log   # what a server with --enable-log-requests served
    chunkserve sim --profile profile.json --workload sharegpt-like --search-rate --slo ttft_p90=2000 --slo tbt_p99=300
    chunkserve sim --profile profile.json --sweep benchmarks/engine/sim_accuracy.yaml

This module holds the flags only (the command line loads without torch); sim_commands.py runs them
on chunkserve/sim/.
"""

from __future__ import annotations

import argparse
from chunkserve.bench import serve as bench_serve
from chunkserve.config.engine import EngineArgs
from chunkserve.entrypoints.args import add_cli_args, from_cli_args

ROUTERS = ("round-robin", "least-load", "prefix")


def add_sim_arguments(parser: argparse.ArgumentParser) -> None:
    sim = parser.add_argument_group("simulation")
    sim.add_argument("--profile", metavar="PROFILE.json", help="the step-time profile (`chunkserve profile`)")
    sim.add_argument("--trace", metavar="REQUESTS.jsonl",
                     help="the requests (docs/SIMULATOR.md has the format); default: the --workload flags")
    sim.add_argument("--from-result", metavar="RESULT.json",
                     help="the requests of a `chunkserve bench serve` result (its workload, rebuilt exactly)")
    sim.add_argument("--from-log", metavar="SERVER.log",
                     help="the requests a server logged with --enable-log-requests (each to its max_tokens)")
    sim.add_argument("--replicas", type=bench_serve.positive_int, default=1, help="engines behind the router")
    sim.add_argument("--router", choices=ROUTERS, default="round-robin",
                     help="how requests pick a replica (with --pd: a prefill and a decode instance)")
    sim.add_argument("--pd", metavar="P:D",
                     help="prefill/decode disaggregation: P prefill and D decode instances of the engine flags, "
                          "KV moving between them over the profile's kv_link (or --kv-link-gbps)")
    sim.add_argument("--kv-link-gbps", type=float, metavar="GBIT/S",
                     help="with --pd: the KV link's rate (default: the profile's measured kv_link)")
    sim.add_argument("--kv-link-latency-us", type=float, metavar="US",
                     help="with --pd: the KV link's one-way latency (default: the profile's, else 0 with --kv-link-gbps)")
    sim.add_argument("--draft-acceptance-rate", type=float, metavar="P",
                     help="with an n-gram --speculative-config: the share of draft tokens that hold (default: the "
                          "profile's, measured on its run)")
    sim.add_argument("--trace-steps", metavar="STEPS.jsonl", help="write every simulated step's record here")
    sim.add_argument("--search-rate", action="store_true",
                     help="find the highest --request-rate meeting every --slo, by bisection")
    sim.add_argument("--slo", action="append", default=[], metavar="METRIC_PCT=MS",
                     help="with --search-rate: e.g. ttft_p90=2000, tbt_p99=300 (ttft, tbt, tpot, e2e; p50, p90, p99)")
    sim.add_argument("--min-rate", type=float, default=0.1)
    sim.add_argument("--max-rate", type=float, default=64.0)
    sim.add_argument("--sweep", metavar="SWEEP.yaml",
                     help="simulate a `chunkserve bench sweep` file's configurations and workloads; rank them")
    sim.add_argument("--out-dir", help="with --sweep: where results go (default: the file's out_dir + '-sim')")
    sim.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    workload = parser.add_argument_group("workload (as `chunkserve bench serve`; its seed is --seed)")
    bench_serve.add_workload_arguments(workload)
    bench_serve.add_result_arguments(workload)
    add_cli_args(EngineArgs, parser.add_argument_group("engine (as `chunkserve serve`)"))


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("traces", nargs="*", metavar="STEPS.jsonl",
                        help="--trace-steps files to fit; none: time synthetic steps on this machine")
    parser.add_argument("-o", "--output", required=True, metavar="PROFILE.json")
    parser.add_argument("--bench-result", action="append", default=[], metavar="RESULT.json",
                        help="`bench serve` results of the traced run: their TTFTs measure the request latency")
    parser.add_argument("--repeats", type=int, default=3, help="synthetic steps: times each shape runs")
    parser.add_argument("--measure-link", action="store_true",
                        help="also measure the KV link prefill/decode instances would use here (loopback, the "
                             "disaggregation connector's transport) for `chunkserve sim --pd`")
    add_cli_args(EngineArgs, parser.add_argument_group("engine (as `chunkserve serve`: the profiled configuration)"))


def engine_args_of(args: argparse.Namespace) -> EngineArgs:
    return from_cli_args(EngineArgs, args)


def sim_main(args: argparse.Namespace) -> None:
    from chunkserve.entrypoints.sim_commands import run_sim

    run_sim(args, engine_args_of(args))


def profile_main(args: argparse.Namespace) -> None:
    from chunkserve.entrypoints.sim_commands import run_profile

    run_profile(args, engine_args_of(args))


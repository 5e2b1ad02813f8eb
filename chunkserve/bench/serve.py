"""`chunkserve bench serve`: benchmark any OpenAI-compatible server (chunkserve, vLLM, SGLang).

It sends a synthetic workload (see workloads.py) as streaming /v1/completions requests of token
ids, times every token on the client, and reports TTFT / TBT / TPOT / E2E, throughput and
goodput under optional SLOs; the interference workload also reports how long prompts stall the
streams already decoding. ``run_benchmark`` returns the same dict it writes as JSON, so a sweep
can call it in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys

import numpy as np
from tqdm import tqdm

from chunkserve.bench.client import run_requests, server_tokenizer
from chunkserve.bench.datasets import DATASET_NAMES, DatasetError, load_sharegpt, sample_sharegpt
from chunkserve.bench.metrics import interference_summary, summarize
from chunkserve.bench.workloads import (
    WORKLOADS,
    RequestSpec,
    build_workload,
    poisson_arrivals,
    sharegpt_like_params,
)

SECRET_ARGS = ("api_key",)
LATENCY_ROWS = (("TTFT", "ttft_ms"), ("TBT", "tbt_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_ms"))
INTERFERENCE_ROWS = (("TBT during long", "tbt_during_long_ms"), ("Stream TBT", "stream_tbt_ms"),
                     ("Long TTFT", "long_ttft_ms"))
COLUMNS = ("p50", "p90", "p99", "max")


def positive_float(text: str) -> float:
    """A float > 0 (``inf`` allowed), for --request-rate."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def ratio(text: str) -> float:
    """A float in [0, 1], for --range-ratio."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `chunkserve bench serve` (names as in vLLM's benchmark where they exist)."""
    parser.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    parser.add_argument("--api-key", default=None, help="sent as Bearer (default: $OPENAI_API_KEY)")
    add_dataset_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-concurrency", type=positive_int, default=None, help="most requests in flight")
    add_workload_arguments(parser)
    add_result_arguments(parser)


def add_result_arguments(parser: argparse.ArgumentParser) -> None:
    """The SLOs goodput counts and where the result goes (also `chunkserve sim`'s)."""
    parser.add_argument("--slo-ttft-ms", type=float, default=None)
    parser.add_argument("--slo-tbt-ms", type=float, default=None, help="bound on every gap between tokens")
    parser.add_argument("--label", default=None, help="free text stored in the result (default: the workload)")
    parser.add_argument("--result-file", default=None, help="write the result as JSON here")


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The synthetic workload's flags (workloads.py; also `chunkserve sim`'s)."""
    parser.add_argument("--workload", choices=WORKLOADS, default="random")
    parser.add_argument("--num-prompts", type=positive_int, default=100)
    parser.add_argument("--request-rate", type=positive_float, default=math.inf,
                        help="Poisson arrivals per second, or inf to send everything at once")
    parser.add_argument("--input-len", type=positive_int, default=256)
    parser.add_argument("--output-len", type=positive_int, default=64)
    parser.add_argument("--range-ratio", type=ratio, default=0.0,
                        help="random workload: lengths uniform in [len*(1-r), len*(1+r)]")
    parser.add_argument("--vocab-size", type=positive_int, default=49152,
                        help="prompt token ids are uniform in [100, vocab_size - 100)")
    interference = parser.add_argument_group("interference workload")
    interference.add_argument("--streams", type=positive_int, default=8, help="decoding requests sent at t=0")
    interference.add_argument("--stream-input-len", type=positive_int, default=64)
    interference.add_argument("--stream-output-len", type=positive_int, default=256)
    interference.add_argument("--long-prompts", type=int, default=3)
    interference.add_argument("--long-len", type=positive_int, default=2048)
    interference.add_argument("--long-every", type=float, default=4.0, help="seconds between long prompts")
    interference.add_argument("--long-output-len", type=positive_int, default=16)
    interference.add_argument("--long-start", type=float, default=2.0,
                              help="seconds after the streams start when the first long prompt arrives")
    prefix = parser.add_argument_group("prefix and multi-turn workloads")
    prefix.add_argument("--prefix-len", type=positive_int, default=512,
                        help="tokens of the shared prefix (multi-turn: the system prompt)")
    prefix.add_argument("--num-prefixes", type=positive_int, default=1, help="prefix: distinct prefixes, used in turn")
    prefix.add_argument("--turns", type=positive_int, default=4, help="multi-turn: turns per chat (--num-prompts chats)")
    prefix.add_argument("--think-time", type=float, default=0.0,
                        help="multi-turn: seconds between a response's end and the next turn")


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's data-set flags, shared by `bench serve` and `bench throughput`."""
    dataset = parser.add_argument_group("data sets (vLLM's flags)")
    dataset.add_argument("--dataset-name", choices=DATASET_NAMES, default="random",
                         help="sharegpt: prompts and output lengths from --dataset-path, sampled as vLLM samples "
                              "them (serve: counted by the server's /tokenize); random: --workload's token ids")
    dataset.add_argument("--dataset-path", default=None, help="the ShareGPT-format JSON file")
    dataset.add_argument("--sharegpt-output-len", type=positive_int, default=None,
                         help="output tokens of every ShareGPT request (default: its reference reply's length)")


def check_dataset_arguments(args: argparse.Namespace) -> None:
    """The data-set flags agree with each other (and, for serve, with --workload)."""
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        raise DatasetError("--dataset-name sharegpt needs --dataset-path FILE (a ShareGPT-format JSON file)")
    if args.dataset_name != "sharegpt" and args.dataset_path:
        raise DatasetError("--dataset-path is read only with --dataset-name sharegpt")
    if args.dataset_name == "sharegpt" and getattr(args, "workload", "random") != "random":
        raise DatasetError(f"--dataset-name sharegpt replaces the synthetic workload: leave out --workload "
                         f"{args.workload}")


def main(args: argparse.Namespace) -> None:
    """Run the benchmark, print its table and (with --result-file) write its JSON."""
    result = run_benchmark(args)
    print(format_table(result))
    if args.result_file:
        print(f"Result written to {args.result_file}")


def run_benchmark(args: argparse.Namespace) -> dict:
    """Run the workload against ``args.base_url``; returns the result dict (the JSON schema)."""
    check_dataset_arguments(args)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    base_url = args.base_url.rstrip("/")
    if args.dataset_name == "sharegpt":
        specs = sharegpt_workload(args, server_tokenizer(base_url, args.model, api_key))
    else:
        specs = build_workload(args, np.random.default_rng(args.seed))
    with tqdm(total=len(specs), file=sys.stderr, unit="req", desc="requests") as bar:
        model, start, results = asyncio.run(run_requests(
            specs, base_url, args.model, api_key, args.max_concurrency, on_done=lambda _: bar.update(1)))
    result = {
        "label": args.label or workload_name(args),
        "workload": workload_name(args),
        "config": config_of(args),
        "base_url": base_url,
        "model": model,
        "bench_start": start,
        "summary": summarize(results, args.slo_ttft_ms, args.slo_tbt_ms),
        "interference": interference_summary(results) if args.workload == "interference" else None,
        "requests": [r.to_dict() for r in results],
    }
    if args.result_file:
        write_json(result, args.result_file)
    return result


def sharegpt_workload(args: argparse.Namespace, tokenize) -> list[RequestSpec]:
    """The ShareGPT file's sampled requests, arriving as a Poisson process at --request-rate."""
    samples = sample_sharegpt(load_sharegpt(args.dataset_path, args.seed), tokenize, args.num_prompts,
                              args.sharegpt_output_len, args.seed)
    send_ats = poisson_arrivals(np.random.default_rng(args.seed), args.request_rate, len(samples))
    return [RequestSpec(s.prompt_token_ids, s.output_len, t, "normal") for s, t in zip(samples, send_ats)]


def workload_name(args: argparse.Namespace) -> str:
    """What ran: the synthetic workload, or the data set's name."""
    return args.workload if args.dataset_name == "random" else args.dataset_name


def config_of(args: argparse.Namespace) -> dict:
    """The args as plain JSON (no secrets, no callables a CLI may have attached; inf as "inf"),
    plus the sharegpt-like length distributions when that workload ran."""
    config = {key: json_value(value) for key, value in vars(args).items()
              if key not in SECRET_ARGS and isinstance(value, (str, int, float, bool, type(None)))}
    config["sharegpt_like"] = (sharegpt_like_params(args.input_len, args.output_len)
                               if args.workload == "sharegpt-like" else None)
    return config


def json_value(value: object) -> object:
    """Non-finite floats as strings: strict JSON has no Infinity."""
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def write_json(result: dict, path: str) -> None:
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def format_table(result: dict) -> str:
    """The summary as aligned plain text: latency percentiles, throughput, goodput, interference."""
    summary, config = result["summary"], result["config"]
    lines = [f"{result['label']}  model={result['model']}  completed={summary['completed']}  "
             f"failed={summary['failed']}  duration={summary['duration_s']:.2f} s", ""]
    lines += stats_table("Latency (ms)", [(name, summary[key]) for name, key in LATENCY_ROWS])
    slos = [f"TTFT <= {config['slo_ttft_ms']} ms" if config.get("slo_ttft_ms") is not None else None,
            f"TBT <= {config['slo_tbt_ms']} ms" if config.get("slo_tbt_ms") is not None else None]
    slo_text = ", ".join(s for s in slos if s) or "no SLO"
    lines += [
        "",
        f"{'Request throughput':<26}{summary['request_throughput']:>10.2f} req/s",
        f"{'Output token throughput':<26}{summary['output_token_throughput']:>10.2f} tok/s",
        f"{'Total token throughput':<26}{summary['total_token_throughput']:>10.2f} tok/s",
        f"{'Goodput':<26}{summary['goodput']:>10.2f} req/s  "
        f"({summary['num_meeting_slo']}/{summary['completed'] + summary['failed']} met {slo_text})",
    ]
    if summary.get("prefix_cache_hit_rate") is not None:
        lines.append(f"{'Prefix cache hit rate':<26}{100 * summary['prefix_cache_hit_rate']:>10.1f} % of prompt tokens")
    if result["interference"] is not None:
        interference = result["interference"]
        lines += [""] + stats_table("Interference (ms)",
                                    [(name, interference[key]) for name, key in INTERFERENCE_ROWS])
    return "\n".join(lines)


def stats_table(title: str, rows: list[tuple[str, dict]]) -> list[str]:
    """Rows of p50/p90/p99/max and the sample count, '-' where there were no samples."""
    def cell(value: float | None) -> str:
        return f"{'-':>10}" if value is None else f"{value:>10.2f}"

    header = f"{title:<18}" + "".join(f"{c:>10}" for c in COLUMNS) + f"{'count':>8}"
    body = [f"{name:<18}" + "".join(cell(stats[c]) for c in COLUMNS) + f"{stats['count']:>8}"
            for name, stats in rows]
    return [header, *body]

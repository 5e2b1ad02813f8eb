"""How many different completions one request gets when it is sent many times under changing
load, with and without --deterministic.

Starts `chunkserve serve` twice through the harness (the default mode, then --deterministic;
the flags after `--` go to both), and sends each `--n` identical completions (temperature 0, then
temperature 0.8 with a seed) in waves of random concurrency 1-16 and random arrival gaps
(chunkserve/bench/identical.py). Counts the unique
completion texts of each (one: the mode holds); the default mode's count is the contrast (issue
42: vLLM #23138, llama.cpp #7052).

    .venv/bin/python -m benchmarks.engine.determinism --json results/determinism.json -- --dtype float32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from collections import Counter

import httpx
import numpy as np

from benchmarks.support import add_model_flag, add_smoke_flag
from chunkserve.bench.host import machine
from chunkserve.bench.identical import send_waves
from chunkserve.bench.service import Service, serve_command

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
SEED = 1234  # the sampled requests' seed
SAMPLINGS = (("greedy", {"temperature": 0.0}), ("temperature 0.8, seed", {"temperature": 0.8, "seed": SEED}))
START_TIMEOUT_S = 600


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_flag(parser)
    add_smoke_flag(parser)
    parser.add_argument("--n", type=int, default=200, help="identical requests per sampling and mode")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per completion (EOS ignored)")
    parser.add_argument("--max-concurrency", type=int, default=16, help="a wave's largest size (each: 1 to this)")
    parser.add_argument("--max-gap-ms", type=float, default=50.0, help="the largest gap between arrivals in a wave")
    parser.add_argument("--seed", type=int, default=0, help="seed of the waves' sizes and gaps")
    parser.add_argument("--json", default=None, help="write the counts and the machine here")
    parser.add_argument("server_flags", nargs=argparse.REMAINDER, help="-- then flags for both servers")
    args = parser.parse_args()
    args.server_flags = [flag for flag in args.server_flags if flag != "--"]
    if args.smoke:
        args.n, args.max_tokens, args.max_concurrency, args.max_gap_ms = 6, 4, 3, 5.0
    return args


def measure_mode(deterministic: bool, args: argparse.Namespace, log_dir: str) -> list[dict]:
    """One server in the mode; per sampling, the unique outputs of its identical requests."""
    flags = [*(["--model", args.model] if args.model else []), *args.server_flags,
             *(["--deterministic"] if deterministic else [])]
    mode = "deterministic" if deterministic else "default"
    rows = []
    with Service(serve_command(*flags), os.path.join(log_dir, f"{mode}.log"), log_mode="w",
                 start_timeout_s=START_TIMEOUT_S) as service:
        service.wait_healthy(show_log=True)
        shown = httpx.get(f"{service.url}/get_server_info", timeout=30).json()["deterministic"]
        if shown is not deterministic:
            raise SystemExit(f"/get_server_info says deterministic={shown} on the {mode} server")
        rng = np.random.default_rng(args.seed)
        for name, sampling in SAMPLINGS:
            body = {"prompt": PROMPT, "max_tokens": args.max_tokens, "ignore_eos": True, **sampling}
            texts = asyncio.run(send_waves(service.url, body, args.n, args.max_concurrency, args.max_gap_ms, rng))
            counts = Counter(texts)
            rows.append({"mode": mode, "sampling": name, "requests": args.n, "unique_outputs": len(counts),
                         "most_common_share": counts.most_common(1)[0][1] / args.n})
    return rows


def main() -> None:
    args = parse_args()
    log_dir = tempfile.mkdtemp(prefix="determinism-")
    modes = (True,) if args.smoke else (False, True)  # the smoke run: one server start, not two
    rows = [row for deterministic in modes for row in measure_mode(deterministic, args, log_dir)]
    host = machine()
    print(f"{args.n} identical requests of {args.max_tokens} tokens, waves of 1-{args.max_concurrency}, "
          f"on {host['cpu']} (server logs: {log_dir})\n")
    print("| mode | sampling | unique outputs | most common output's share |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['mode']} | {row['sampling']} | {row['unique_outputs']} | {row['most_common_share']:.0%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": host, "model": args.model, "server_flags": args.server_flags, "n": args.n,
                       "max_tokens": args.max_tokens, "max_concurrency": args.max_concurrency,
                       "max_gap_ms": args.max_gap_ms, "seed": args.seed, "rows": rows}, f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())

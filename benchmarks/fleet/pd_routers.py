"""A prefill/decode pair behind SMG's `--pd-disaggregation` against the same pair behind
`chunkserve router --pd-disaggregation`: the same requests, the same processes and pinning, only
the router differs. SMG is the documented router for chunkserve's prefill/decode pairs (README,
"Serving a fleet"); this says what that costs or gains against chunkserve's own.

Per run, fresh instances: a prefill instance on core 0 and a decode instance on core 1 (one
thread each, `--metrics-compat sglang`: SMG reads their load from those gauges), the router on
core 1 with the load generator (this process), as benchmarks/engine/pd_interference.py's (c).
The workload is `chunkserve bench serve`'s random one as text (SMG takes no token-id prompt; the
text encodes back to exactly the drawn tokens): `--num-prompts` prompts of `--input-len` tokens,
`--output-len` tokens each, Poisson arrivals at `--rate`. Rounds alternate the routers' order;
the table gives medians over rounds of TTFT, TBT and E2E p50/p99, output tok/s and failures.

    python -m benchmarks.fleet.pd_routers --rounds 3 --out pd_routers.json
    python -m benchmarks.fleet.pd_routers --smoke --model TINY.gguf      # one short round
    python -m benchmarks.fleet.pd_routers --dry-run                      # the processes, nothing started
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from benchmarks.support import text_workload  # benchmarks/support.py
from chunkserve.bench.client import run_requests
from chunkserve.bench.host import machine
from chunkserve.bench.metrics import summarize
from chunkserve.bench.service import Service, free_port, serve_command
from chunkserve.bench.smg import smg_binary, smg_command, wait_smg_workers
from chunkserve.config.model import resolve_model
from chunkserve.engine.tokenizer import load_tokenizer

ROUTERS = ("chunkserve", "smg")
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive"}
ROWS = (("TTFT", "ttft_ms"), ("TBT", "tbt_ms"), ("E2E", "e2e_ms"))


def instance_commands(args: argparse.Namespace, bootstrap_port: int) -> tuple[list[str], list[str]]:
    model = ["--model", args.model] if args.model else []
    common = [*model, "--max-model-len", str(args.max_model_len), "--metrics-compat", "sglang"]
    prefill = serve_command(*common, "--disaggregation-mode", "prefill",
                            "--disaggregation-bootstrap-port", str(bootstrap_port))
    return prefill, serve_command(*common, "--disaggregation-mode", "decode")


def router_command(router: str, prefill_url: str, bootstrap_port: int, decode_url: str) -> list[str]:
    pair = ["--pd-disaggregation", "--prefill", prefill_url, str(bootstrap_port), "--decode", decode_url]
    if router == "smg":
        return smg_command(*pair, metrics_port=free_port())
    return [sys.executable, "-m", "chunkserve.entrypoints.cli", "router", *pair, "--host", "127.0.0.1",
            "--log-level", "warning"]


@contextmanager
def deployment(router: str, args: argparse.Namespace, workdir: str, tag: str) -> Iterator[str]:
    """The pair and `router` before it, all up; yields the router's URL."""
    bootstrap_port = free_port()
    prefill_command, decode_command = instance_commands(args, bootstrap_port)
    env = {**os.environ, **ONE_THREAD}
    log = os.path.join(workdir, f"{tag}.log")
    with Service(prefill_command, log, "0", env, label="prefill") as prefill, \
            Service(decode_command, log, "1", env, label="decode") as decode:
        prefill.wait_healthy(show_log=True)
        decode.wait_healthy(show_log=True)
        with Service(router_command(router, prefill.url, bootstrap_port, decode.url), log, "1",
                     label=f"{router} router") as front:
            if router == "smg":
                wait_smg_workers(front.url, front.popen, 2, log_path=log)
            else:
                front.wait_healthy(show_log=True)
            yield front.url


def measure(router: str, args: argparse.Namespace, workdir: str, tag: str, specs: list) -> dict:
    with deployment(router, args, workdir, tag) as url:
        model, _, results = asyncio.run(run_requests(specs, url, args.served_model_name, None, None))
    summary = summarize(results)
    return {"router": router, "completed": summary["completed"], "failed": summary["failed"],
            "output_tok_s": summary["output_token_throughput"],
            **{key: {p: summary[key][p] for p in ("p50", "p99")} for _, key in ROWS},
            "errors": sorted({r.error for r in results if r.error})[:5]}


def medians(runs: list[dict]) -> dict:
    def median(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    out = {"rounds": len(runs), "failed": sum(r["failed"] for r in runs),
           "output_tok_s": median([r["output_tok_s"] for r in runs])}
    for _, key in ROWS:
        out[key] = {p: median([r[key][p] for r in runs]) for p in ("p50", "p99")}
    return out


def table(summaries: dict[str, dict]) -> str:
    lines = ["| router | TTFT p50 / p99 (ms) | TBT p50 / p99 (ms) | E2E p50 / p99 (ms) | output tok/s | failed |",
             "|---|---|---|---|---|---|"]
    for router, s in summaries.items():
        cells = [f"{s[key]['p50']:.0f} / {s[key]['p99']:.0f}" for _, key in ROWS]
        lines.append(f"| {router} | {' | '.join(cells)} | {s['output_tok_s']:.1f} | {s['failed']} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--routers", type=lambda text: text.split(","), default=list(ROUTERS))
    parser.add_argument("--rounds", type=int, default=3, help="each round runs every router once (order alternates)")
    parser.add_argument("--num-prompts", type=int, default=24)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rate", type=float, default=0.5, help="requests per second (Poisson)")
    parser.add_argument("--model", default=None, help="the instances' model (default: chunkserve's default)")
    parser.add_argument("--served-model-name", default=None, help="(default: the first of /v1/models)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--out", default=None, help="the JSON result")
    parser.add_argument("--smoke", action="store_true", help="one round of 4 short requests (checks the script)")
    parser.add_argument("--dry-run", action="store_true", help="print the processes; start nothing")
    args = parser.parse_args(argv)
    if unknown := set(args.routers) - set(ROUTERS):
        parser.error(f"unknown routers {sorted(unknown)}; known: {', '.join(ROUTERS)}")
    if args.smoke:
        args.rounds, args.num_prompts, args.input_len, args.output_len, args.max_model_len = 1, 4, 48, 8, 512
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.dry_run:
        prefill, decode = instance_commands(args, 8998)
        print(f"{args.rounds} rounds of {', '.join(args.routers)}; prefill (core 0): {' '.join(prefill)}")
        print(f"decode (core 1): {' '.join(decode)}")
        for router in args.routers:
            if router != "smg" or smg_binary() is not None:
                print(f"{router} (core 1): {' '.join(router_command(router, 'PREFILL', 8998, 'DECODE'))}")
        return
    tokenizer = load_tokenizer(resolve_model(args.model))
    shape = argparse.Namespace(workload="random", num_prompts=args.num_prompts, input_len=args.input_len,
                               output_len=args.output_len, range_ratio=0.0, request_rate=args.rate)
    runs: dict[str, list[dict]] = {router: [] for router in args.routers}
    with tempfile.TemporaryDirectory(prefix="pd-routers-") as workdir:
        for round_index in range(args.rounds):
            specs = text_workload(shape, round_index, tokenizer)
            order = args.routers if round_index % 2 == 0 else args.routers[::-1]
            for router in order:
                runs[router].append(measure(router, args, workdir, f"{router}-{round_index}", specs))
                print(f"round {round_index + 1}/{args.rounds}, {router}: {json.dumps(runs[router][-1])}",
                      file=sys.stderr)
    summaries = {router: medians(done) for router, done in runs.items()}
    print(table(summaries))
    if args.out:
        with open(args.out, "w") as out:
            json.dump({"machine": machine(), "config": vars(args), "summaries": summaries, "runs": runs}, out, indent=2)


if __name__ == "__main__":
    main()

"""How close `chunkserve sim --pd 1:1` comes to a real prefill/decode pair, on a profile that
never saw a disaggregated step.

benchmarks/engine/pd_interference.py runs the `interference` workload against (b) one server on
core 0 (1 thread) and (c) a prefill instance on core 0 and a decode instance on core 1 (1
thread each) behind `chunkserve router`, and keeps every server's step trace. From one round:

- `held out`: a profile fitted on (b)'s trace (a colocated 1-thread engine: prompt chunks and
  decodes), its request latency from (b)'s TTFTs, the KV link measured here
  (`chunkserve profile --measure-link`), then (c)'s workload simulated as `--pd 1:1`;
- `in sample`, for scale: (b) simulated on the same profile, and (c) on a profile fitted on
  (c)'s own two traces (same link).

It prints real against simulated: stream TBT during the long prompts (p50, p99), the streams'
TBT over the run, the long prompts' TTFT (p50) and output tokens/s, each with its error.

    .venv/bin/python -m benchmarks.engine.pd_interference --rounds 1 --configs b,c \\
        --workdir bench-results/pd-sim --out bench-results/pd-sim/results.json
    .venv/bin/python -m benchmarks.engine.sim_pd_accuracy --results bench-results/pd-sim/results.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os

from benchmarks.support import add_smoke_flag
from chunkserve.bench import serve as bench_serve
from chunkserve.entrypoints import cli

# pd_interference's servers: budget 256 (the decode instance's budget never binds: it computes no prompt)
ENGINE_FLAGS = ["--max-num-batched-tokens", "256"]
METRICS = (  # (label, where in a result, statistic)
    ("stream TBT during long p50 (ms)", ("interference", "tbt_during_long_ms"), "p50"),
    ("stream TBT during long p99 (ms)", ("interference", "tbt_during_long_ms"), "p99"),
    ("stream TBT p50 (ms)", ("interference", "stream_tbt_ms"), "p50"),
    ("long TTFT p50 (ms)", ("interference", "long_ttft_ms"), "p50"),
    ("output tok/s", ("summary", "output_token_throughput"), None),
)


def value_of(result: dict, path: tuple[str, str], stat: str | None) -> float | None:
    cell = result.get(path[0]) or {}
    cell = cell.get(path[1])
    if stat is not None:
        cell = (cell or {}).get(stat)
    return cell


def run_cli(argv: list[str]) -> str:
    """`chunkserve ...` in this process; what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        cli.main(argv)
    return out.getvalue()


def profile_of(traces: list[str], bench_result: str, kv_flags: list[str], path: str) -> str:
    run_cli(["profile", *traces, "-o", path, *ENGINE_FLAGS, *kv_flags, "--bench-result", bench_result,
             "--measure-link"])
    return path


def simulate(profile: str, bench_result: str, kv_flags: list[str], out: str, pd: bool) -> dict:
    run_cli(["sim", "--profile", profile, "--from-result", bench_result, *ENGINE_FLAGS, *kv_flags,
             *(["--pd", "1:1"] if pd else []), "--result-file", out, "--disable-tqdm"])
    with open(out) as f:
        return json.load(f)


def table(rows: dict[str, tuple[dict, dict]]) -> str:
    """One line per metric: real and simulated per comparison, with the relative error."""
    names = list(rows)
    lines = ["| metric | " + " | ".join(f"{name}: real / sim (error)" for name in names) + " |",
             "|---|" + "---|" * len(names)]
    for label, path, stat in METRICS:
        cells = []
        for real, simulated in rows.values():
            a, b = value_of(real, path, stat), value_of(simulated, path, stat)
            if a is None or b is None:
                cells.append("-")
                continue
            error = (b - a) / a if a else float("nan")
            cells.append(f"{a:,.1f} / {b:,.1f} ({error:+.1%})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", help="pd_interference.py's --out JSON (its workdir holds the traces)")
    parser.add_argument("--round", type=int, default=1, help="which of its rounds")
    parser.add_argument("--out", default=None, help="where profiles and simulated results go (default: beside "
                                                    "--results)")
    add_smoke_flag(parser, "check the script's flags and exit (it needs a real pd_interference run)")
    args = parser.parse_args()
    if args.smoke:
        print("sim_pd_accuracy: needs pd_interference.py's results (--results); flags parsed")
        return
    if not args.results:
        parser.error("--results is required (pd_interference.py's --out JSON)")
    with open(args.results) as f:
        real = json.load(f)
    runs = real["runs"][args.round - 1]
    missing = [c for c in ("b", "c") if c not in runs]
    if missing:
        parser.error(f"round {args.round} has no configuration {', '.join(missing)}: run pd_interference.py with "
                     "--configs b,c")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.results)), "sim")
    os.makedirs(out, exist_ok=True)
    kv_flags = ["--kv-cache-memory-gb", str(real["args"]["kv_cache_memory_gb"])]
    bench = {}
    for config in ("b", "c"):
        bench[config] = os.path.join(out, f"real-{config}.json")
        bench_serve.write_json(runs[config]["bench"], bench[config])
    colocated = profile_of([runs["b"]["traces"]["server"]], bench["b"], kv_flags, os.path.join(out, "profile-b.json"))
    pair = profile_of([runs["c"]["traces"]["prefill"], runs["c"]["traces"]["decode"]], bench["c"], kv_flags,
                      os.path.join(out, "profile-c.json"))
    rows = {
        "(c) pair, held out ((b)'s profile)": (runs["c"]["bench"], simulate(colocated, bench["c"], kv_flags,
                                                                            os.path.join(out, "sim-c-from-b.json"),
                                                                            pd=True)),
        "(c) pair, in sample": (runs["c"]["bench"], simulate(pair, bench["c"], kv_flags,
                                                             os.path.join(out, "sim-c-from-c.json"), pd=True)),
        "(b) colocated, in sample": (runs["b"]["bench"], simulate(colocated, bench["b"], kv_flags,
                                                                  os.path.join(out, "sim-b-from-b.json"), pd=False)),
    }
    with open(colocated) as f:
        link = json.load(f)["kv_link"]
    print(f"machine: {real['machine'].get('cpu')}; round {args.round}; KV link measured here: {link}")
    print(table(rows))
    print(f"\nprofiles and simulated results in {out}")


if __name__ == "__main__":
    main()

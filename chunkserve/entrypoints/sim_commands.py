"""What `chunkserve sim` and `chunkserve profile` do (their flags: sim_cli.py, which loads this
module, and with it the engine, only when one of them runs)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import sys
from typing import Any

import numpy as np
from tqdm import tqdm

from chunkserve.bench import serve as bench_serve
from chunkserve.bench import sweep as bench_sweep
from chunkserve.bench.host import machine
from chunkserve.config.engine import EngineArgs
from chunkserve.config.model import resolve_model
from chunkserve.entrypoints.args import add_cli_args, from_cli_args
from chunkserve.errors import InvalidRequestError
from chunkserve.sim.profile import StepTimeProfile, fit_profile, read_trace
from chunkserve.sim.search import SLO, run_sweep, search_rate
from chunkserve.sim.link import LinkModel, measure_link
from chunkserve.sim.simulator import parse_pd, result_json, simulate, write_step_records
from chunkserve.sim.trace import SimRequest, from_bench_result, from_request_log, from_workload, read_request_trace

logger = logging.getLogger(__name__)


def requests_of(args: argparse.Namespace) -> tuple[list[SimRequest], str]:
    """The requests to simulate and the workload's name."""
    given = [flag for flag, value in (("--trace", args.trace), ("--from-result", args.from_result),
                                      ("--from-log", args.from_log)) if value]
    if len(given) > 1:
        raise InvalidRequestError(f"give the requests once, not with {' and '.join(given)}")
    if args.trace:
        return read_request_trace(args.trace), "trace"
    if args.from_result:  # (named as the result's workload: an interference run gets its interference summary)
        requests = from_bench_result(args.from_result)
        with open(args.from_result) as f:
            return requests, json.load(f).get("workload") or "result"
    if args.from_log:
        return from_request_log(args.from_log, lambda text: _tokenizer(args.model, args.tokenizer).encode(text)), "log"
    return from_workload(args), args.workload


@functools.cache
def _tokenizer(model: str | None, tokenizer: str | None):
    from chunkserve.engine.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(model), tokenizer)


def run_sim(args: argparse.Namespace, engine_args: EngineArgs) -> None:
    if not args.profile:
        raise InvalidRequestError("chunkserve sim needs --profile PROFILE.json (make one with `chunkserve profile`)")
    profile = StepTimeProfile.load(args.profile)
    print(f"profile: {args.profile} ({profile.describe()})", file=sys.stderr)
    if args.sweep:
        _run_sweep(args, engine_args, profile)
    elif args.search_rate:
        _search_rate(args, engine_args, profile)
    else:
        requests, workload = requests_of(args)
        result = simulate_requests(args, engine_args, profile, requests, workload, progress=not args.disable_tqdm)
        print(bench_serve.format_table(result))
        simulator = result["simulator"]
        print(f"simulated {simulator['simulated_s']:.1f} s ({simulator['steps']} steps) in {simulator['wall_s']:.1f} s")
        if args.result_file:
            bench_serve.write_json(result, args.result_file)
            print(f"Result written to {args.result_file}")


def simulate_requests(args: argparse.Namespace, engine_args: EngineArgs, profile: StepTimeProfile,
                      requests: list[SimRequest], workload: str, progress: bool = False) -> dict[str, Any]:
    """One simulated run as a bench result (and its step records, with --trace-steps)."""
    total = sum(r.n for r in requests)
    pd = parse_pd(args.pd) if args.pd else None
    with tqdm(total=total, file=sys.stderr, unit="req", desc="simulated", disable=not progress) as bar:
        run = simulate(requests, engine_args, profile, args.replicas, args.router,
                       on_finished=lambda: bar.update(1), pd=pd, link=link_of(args, profile) if pd else None,
                       draft_acceptance_rate=getattr(args, "draft_acceptance_rate", None))
    if getattr(args, "trace_steps", None):
        write_step_records(run, args.trace_steps)
    config = {**bench_serve.config_of(args), "engine": _plain(dataclasses.asdict(engine_args))}
    return result_json(run, profile, args.label or workload, workload, config, args.slo_ttft_ms, args.slo_tbt_ms)


def link_of(args: argparse.Namespace, profile: StepTimeProfile) -> LinkModel | None:
    """The KV link of a --pd fleet: --kv-link-gbps (and --kv-link-latency-us), else the profile's."""
    measured = profile.link()
    if measured is None and args.kv_link_gbps is None:
        return None
    changes = {}
    if args.kv_link_gbps is not None:
        changes["bytes_per_s"] = args.kv_link_gbps * 1e9 / 8
    if args.kv_link_latency_us is not None:
        changes["latency_s"] = args.kv_link_latency_us * 1e-6
    return dataclasses.replace(measured or LinkModel(1.0), **changes)


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if isinstance(v, (str, int, float, bool, type(None)))}


def _search_rate(args: argparse.Namespace, engine_args: EngineArgs, profile: StepTimeProfile) -> None:
    if args.trace or args.from_result or args.from_log:
        raise InvalidRequestError("--search-rate varies a workload's Poisson rate: give --workload flags, not a trace")
    if args.workload == "interference":
        raise InvalidRequestError("--search-rate needs a workload with Poisson arrivals (not interference)")
    slos = [SLO.parse(text) for text in args.slo]
    if not slos:
        raise InvalidRequestError("--search-rate needs at least one --slo, e.g. --slo tbt_p99=300")

    def run_at(rate: float) -> dict[str, Any]:
        probe = argparse.Namespace(**{**vars(args), "request_rate": rate})
        summary = simulate_requests(probe, engine_args, profile, from_workload(probe), args.workload)["summary"]
        print(f"rate {rate:.3f} req/s: " + ", ".join(
            f"{slo.metric} {slo.percentile} {summary[f'{slo.metric}_ms'][slo.percentile]:.0f} ms" for slo in slos),
            file=sys.stderr)
        return summary

    best, probes = search_rate(run_at, slos, args.min_rate, args.max_rate)
    answer = f"< {args.min_rate}" if best is None else f"{best:.3f}"
    print(f"highest rate meeting {', '.join(map(str, slos))}: {answer} req/s ({len(probes)} probes)")
    if args.result_file:
        bench_serve.write_json({"capacity_rps": best, "slos": [str(s) for s in slos], "probes": probes,
                                "profile": profile.provenance}, args.result_file)


def _run_sweep(args: argparse.Namespace, engine_args: EngineArgs, profile: StepTimeProfile) -> None:
    sweep = bench_sweep.SweepConfig.load(args.sweep)
    sweep.out_dir = args.out_dir or sweep.out_dir + "-sim"
    serve_parser = argparse.ArgumentParser(add_help=False)
    add_cli_args(EngineArgs, serve_parser)
    base = ["--model", engine_args.model] if engine_args.model else []

    fleet_parser = argparse.ArgumentParser("a sweep configuration's fleet flags", add_help=False)
    fleet_parser.add_argument("--replicas", type=bench_serve.positive_int, default=args.replicas)
    fleet_parser.add_argument("--router", default=args.router)
    fleet_parser.add_argument("--pd", default=args.pd)

    def simulate_config(serve_flags: list[str], workload: argparse.Namespace, label: str) -> dict[str, Any]:
        fleet, engine_flags = fleet_parser.parse_known_args(serve_flags)
        config_args = from_cli_args(EngineArgs, serve_parser.parse_args([*base, *engine_flags]))
        run_args = argparse.Namespace(**{**vars(args), **vars(workload), **vars(fleet), "label": label,
                                         "trace_steps": None})
        return simulate_requests(run_args, config_args, profile, from_workload(run_args), workload.workload)

    tables, _ = run_sweep(sweep, simulate_config, log=lambda text: print(f"[sim] {text}", file=sys.stderr))
    print(tables)
    with open(os.path.join(sweep.out_dir, "summary.md"), "w") as f:
        f.write(tables + "\n")


# ----- chunkserve profile -------------------------------------------------------------------------


def run_profile(args: argparse.Namespace, engine_args: EngineArgs) -> None:
    if args.traces:
        records = [record for path in args.traces for record in read_trace(path)]
        source = ", ".join(args.traces)
    else:
        records = synthetic_records(engine_args, args.repeats)
        source = "synthetic steps (chunkserve profile)"
    profile = fit_profile(records, **_described(engine_args, source))
    if args.measure_link:
        from chunkserve.model.loader import load_model_config

        link = measure_link(profile.kv_bytes_per_block, load_model_config(resolve_model(engine_args.model)),
                            engine_args.dtype, engine_args.block_size)
        profile = dataclasses.replace(profile, kv_link=dataclasses.asdict(link))
        print(f"KV link (loopback): {link.describe()}")
    if args.bench_result:
        profile = dataclasses.replace(profile, request_latency_s=request_latency(profile, engine_args,
                                                                                 args.bench_result))
    profile.save(args.output)
    print(f"profile of {len(profile.residuals)} steps written to {args.output}: {profile.describe()}")
    print("  " + ", ".join(f"{name} {value:.3g} s" for name, value in profile.coefficients.items()))
    ratios = np.array(profile.residuals)
    print(f"  actual / predicted: p50 {np.median(ratios):.3f}, p99 {np.quantile(ratios, 0.99):.3f}; "
          f"step gap {profile.step_gap_s * 1e3:.2f} ms; request latency {profile.request_latency_s * 1e3:.1f} ms")


def _described(engine_args: EngineArgs, source: str) -> dict[str, Any]:
    """The profile's KV bytes per block and provenance: what it describes."""
    from chunkserve.model.loader import TORCH_DTYPES, load_model_config
    from chunkserve.worker.kv_cache import kv_bytes_per_token

    model = resolve_model(engine_args.model)
    config = load_model_config(model)
    host = machine()
    provenance = {
        "cpu": f"{host.get('cpu')} (family {host.get('cpu_family')}, model {host.get('cpu_model')})",
        "model": os.path.basename(model.path), "architecture": config.architecture,
        "dtype": engine_args.dtype, "op_backend": engine_args.op_backend,
        "tensor_parallel_size": engine_args.tensor_parallel_size,
        "pipeline_parallel_size": engine_args.pipeline_parallel_size, "commit": host.get("commit"), "source": source,
    }
    per_block = kv_bytes_per_token(config, TORCH_DTYPES[engine_args.dtype]) * engine_args.block_size
    return {"kv_bytes_per_block": per_block, "block_size": engine_args.block_size, "provenance": provenance}


def request_latency(profile: StepTimeProfile, engine_args: EngineArgs, result_paths: list[str]) -> float:
    """What a request's way into and out of the core adds to its TTFT: the median of the real
    TTFTs over the simulated ones (same requests, same flags, no latency), at least 0."""
    differences = []
    for path in result_paths:
        with open(path) as f:
            real = json.load(f)
        run = simulate(from_bench_result(path), engine_args, profile)
        simulated = [r.token_times[0] - r.send_time for r in run.results]
        differences += [row["token_times"][0] - row["send_time"] - sim
                        for row, sim in zip(real["requests"], simulated) if row["ok"] and row["token_times"]]
    return max(0.0, float(np.median(differences))) if differences else 0.0


def synthetic_records(engine_args: EngineArgs, repeats: int) -> list[dict[str, Any]]:
    """Time a grid of synthetic steps on this machine (the engine's own start-up profile, wider):
    prompt chunks of 16 to 2048 tokens after contexts of 0 to 2048, decode batches of 1 to 64
    at contexts of 64 to 2048, and mixes. Records in the --trace-steps form the fit reads."""
    from chunkserve.core.step_predictor import StepShape
    from chunkserve.engine.core import EngineCore

    core = EngineCore(engine_args)
    try:
        limit = core.max_model_len
        budget = core.scheduler_config.max_num_batched_tokens
        steps = [[(context, chunk)] for chunk in (16, 64, 256, 512, 1024, 2048) for context in (0, 512, 2048)
                 if chunk <= budget and context + chunk <= limit]
        steps += [[(context, 1)] * rows for rows in (1, 4, 8, 16, 32, 64) for context in (64, 512, 2048)
                  if rows <= core.scheduler_config.max_num_seqs and context < limit]
        steps += [[(256, 1)] * rows + [(0, chunk)] for rows in (4, 16) for chunk in (64, 256)
                  if chunk + rows <= budget]
        core.time_synthetic_step(steps[0])  # warm-up
        records, clock = [], 0.0
        with tqdm(total=len(steps) * repeats, file=sys.stderr, unit="step", desc="profiling") as bar:
            for repeat in range(repeats):
                for index, rows in enumerate(steps):
                    seconds = core.time_synthetic_step(rows, seed=repeat * len(steps) + index)
                    records.append({"start_time": clock, "duration_s": seconds,
                                    "shape": list(StepShape.of_rows(rows).counts)})
                    clock += seconds + 1.0  # (synthetic steps have no engine-loop gap to measure)
                    bar.update(1)
        return records
    finally:
        core.shutdown()

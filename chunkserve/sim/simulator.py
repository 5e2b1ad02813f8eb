"""`chunkserve sim`'s engine: requests through simulated replicas, out as a `chunkserve bench
serve` result (same JSON, so `bench plot` and the sweep tables read it) and step records in
the `--trace-steps` schema.

What is simulated and what is not: the scheduling is the engine's own (the real `EngineCore`
on a virtual clock); step times come from a profile of some machine; requests end at their
trace's output length (as `bench serve` asks: max_tokens with ignore_eos). Not simulated, and
refused with a message: pipeline parallelism (steps in flight), disaggregation, the disk KV
tier and speculative decoding (draft acceptance depends on the text).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from chunkserve.bench.client import RequestResult
from chunkserve.bench.metrics import interference_summary, summarize
from chunkserve.config.engine import EngineArgs
from chunkserve.config.model import resolve_model
from chunkserve.errors import InvalidRequestError
from chunkserve.model.config import ModelConfig
from chunkserve.model.loader import TORCH_DTYPES, load_model_config
from chunkserve.sim.fleet import run_fleet
from chunkserve.sim.profile import StepTimeProfile
from chunkserve.sim.replica import Latencies, Replica
from chunkserve.sim.timing import ProfileTimer, ReplayTimer
from chunkserve.sim.trace import SimRequest
from chunkserve.worker.kv_cache import kv_bytes_per_token, num_blocks_for_memory


def check_simulable(engine_args: EngineArgs) -> None:
    """Refuse, naming the flag, what the simulator cannot run."""
    refusals = [
        (engine_args.pipeline_parallel_size > 1, "--pipeline-parallel-size above 1 (steps in flight)"),
        (engine_args.disaggregation_mode != "null", "--disaggregation-mode (use --pd P:D... not yet: see docs)"),
        (engine_args.enable_hierarchical_cache, "--enable-hierarchical-cache (the disk KV tier)"),
        (engine_args.speculative_config is not None, "--speculative-config (draft acceptance depends on the text)"),
    ]
    refused = [flag for bad, flag in refusals if bad]
    if refused:
        raise InvalidRequestError(f"chunkserve sim does not simulate {refused[0]}")


def num_kv_blocks(engine_args: EngineArgs, model_config: ModelConfig, profile: StepTimeProfile) -> int:
    """The KV blocks the simulated engine gets: --num-kv-blocks, else the KV memory over the
    profile's bytes per block (its machine's dtype), else over this model's at --dtype."""
    if engine_args.num_kv_blocks:
        return engine_args.num_kv_blocks
    if profile.kv_bytes_per_block:
        return engine_args.kv_cache_bytes // profile.kv_bytes_per_block
    per_token = kv_bytes_per_token(model_config, TORCH_DTYPES[engine_args.dtype])
    return num_blocks_for_memory(per_token, engine_args.kv_cache_bytes, engine_args.block_size)


@dataclass
class SimRun:
    results: list[RequestResult]
    replicas: list[Replica]
    wall_s: float

    @property
    def simulated_s(self) -> float:
        return max(r.clock.now for r in self.replicas) - min(r.send_time for r in self.results)

    def step_records(self) -> list[dict[str, Any]]:
        """Every replica's step records (`--trace-steps` lines), with `replica` when several."""
        lines = []
        for index, replica in enumerate(self.replicas):
            for record in replica.core.step_records:
                line = record.to_dict()
                if len(self.replicas) > 1:
                    line["replica"] = index
                lines.append(line)
        return lines


def simulate(requests: list[SimRequest], engine_args: EngineArgs, profile: StepTimeProfile | None = None,
             replicas: int = 1, router: str = "round-robin",
             replay: list[dict[str, Any]] | None = None, start_time: float = 0.0, record_steps: bool = False,
             on_finished: Callable[[], None] | None = None) -> SimRun:
    """Serve `requests` on `replicas` simulated engines of `engine_args`, steps timed by
    `profile` (residuals drawn by `engine_args.seed`, the run's one seed) or, with `replay`, by a
    recorded run's step records
    (one replica; its clock starts at `start_time`, the recorded run's first step)."""
    check_simulable(engine_args)
    if (profile is None) == (replay is None):
        raise InvalidRequestError("a simulation needs a step-time profile, or a recorded run to replay")
    if replay is not None and replicas != 1:
        raise InvalidRequestError("a replay runs one replica: the recorded run's")
    model_config = load_model_config(resolve_model(engine_args.model))
    latencies = Latencies()
    if profile is not None:
        latencies = Latencies(profile.request_latency_s, profile.output_latency_s)
        blocks = num_kv_blocks(engine_args, model_config, profile)
    else:
        blocks = num_kv_blocks(engine_args, model_config, StepTimeProfile({}))
    fleet = []
    for index in range(replicas):
        timer = ReplayTimer(replay) if replay is not None else ProfileTimer(profile, (engine_args.seed, index))
        fleet.append(Replica(engine_args, model_config, blocks, timer, latencies, start_time, record_steps))
    started = time.perf_counter()  # the simulator's own cost, reported; never part of simulated time
    results = run_fleet(requests, fleet, router, start_time, on_finished)
    return SimRun(results, fleet, time.perf_counter() - started)


def result_json(run: SimRun, profile: StepTimeProfile | None, label: str, workload: str, config: dict[str, Any],
                slo_ttft_ms: float | None = None, slo_tbt_ms: float | None = None) -> dict[str, Any]:
    """The run as `chunkserve bench serve` writes a result, plus what simulated it."""
    start = min(r.send_time for r in run.results)
    return {
        "label": label,
        "workload": workload,
        "config": config,
        "base_url": None,
        "model": config.get("model"),
        "bench_start": start,
        "summary": summarize(run.results, slo_ttft_ms, slo_tbt_ms),
        "interference": interference_summary(run.results) if workload == "interference" else None,
        "requests": [r.to_dict() for r in run.results],
        "simulator": {
            "profile": dataclasses.asdict(profile)["provenance"] if profile is not None else "replay",
            "replicas": len(run.replicas),
            "steps": sum(len(r.core.step_records) for r in run.replicas),
            "simulated_s": run.simulated_s,
            "wall_s": run.wall_s,
            "request_latency_s": profile.request_latency_s if profile is not None else None,
            "output_latency_s": profile.output_latency_s if profile is not None else None,
        },
    }


def write_step_records(run: SimRun, path: str) -> None:
    with open(path, "w") as f:
        for line in run.step_records():
            f.write(json.dumps(line) + "\n")

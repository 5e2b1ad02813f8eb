"""`chunkserve sim`'s engine: requests through simulated replicas, out as a `chunkserve bench
serve` result (same JSON, so `bench plot` and the sweep tables read it) and step records in
the `--trace-steps` schema.

What is simulated and what is not: the scheduling is the engine's own (the real `EngineCore`
on a virtual clock); step times come from a profile of some machine; requests end at their
trace's output length (as `bench serve` asks: max_tokens with ignore_eos). Not simulated, and
refused with a message: pipeline parallelism (steps in flight), the disk KV tier and a draft
model (its forward is not in a step-time profile). Prefill/decode disaggregation is simulated as
a fleet (`pd`: sim/disagg.py), not as one instance's --disaggregation-mode. N-gram speculative
decoding runs the engine's own proposer and draft policy on output text whose drafts hold at the
profile's (or the caller's) draft acceptance rate (executor/simulated.py's SyntheticText).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from chunkserve.bench.client import RequestResult
from chunkserve.bench.metrics import interference_summary, summarize
from chunkserve.config.engine import EngineArgs
from chunkserve.config.model import resolve_model
from chunkserve.config.speculative import SpeculativeConfig
from chunkserve.core.clock import VirtualClock
from chunkserve.core.disagg.decode import DecodeConnectorScheduler
from chunkserve.core.disagg.prefill import PrefillConnectorScheduler
from chunkserve.errors import InvalidRequestError
from chunkserve.executor.simulated import SyntheticText
from chunkserve.model.config import ModelConfig
from chunkserve.model.loader import TORCH_DTYPES, load_model_config
from chunkserve.sim.disagg import KVLink, SimDecodeConnector, SimPrefillConnector, prefill_name
from chunkserve.sim.fleet import run_fleet
from chunkserve.sim.link import LinkModel
from chunkserve.sim.profile import StepTimeProfile
from chunkserve.sim.replica import Latencies, Replica
from chunkserve.sim.timing import ProfileTimer, ReplayTimer
from chunkserve.sim.trace import SimRequest
from chunkserve.worker.kv_cache import kv_bytes_per_token, num_blocks_for_memory


def check_simulable(engine_args: EngineArgs) -> None:
    """Refuse, naming the flag, what the simulator cannot run."""
    refusals = [
        (engine_args.pipeline_parallel_size > 1, "--pipeline-parallel-size above 1 (steps in flight)"),
        (engine_args.disaggregation_mode != "null", "--disaggregation-mode (a prefill/decode fleet is --pd P:D)"),
        (engine_args.enable_hierarchical_cache, "--enable-hierarchical-cache (the disk KV tier)"),
        (engine_args.speculative_config is not None
         and SpeculativeConfig.parse(engine_args.speculative_config).method == "draft_model",
         '--speculative-config with method "draft_model" (its forward is not in a step-time profile; '
         '"ngram" is simulated)'),
    ]
    refused = [flag for bad, flag in refusals if bad]
    if refused:
        raise InvalidRequestError(f"chunkserve sim does not simulate {refused[0]}")


def kv_block_bytes(engine_args: EngineArgs, model_config: ModelConfig, profile: StepTimeProfile) -> int:
    """One KV block's bytes: the profile's (its machine's dtype), else this model's at --dtype."""
    if profile.kv_bytes_per_block:
        return profile.kv_bytes_per_block
    return kv_bytes_per_token(model_config, TORCH_DTYPES[engine_args.dtype]) * engine_args.block_size


def num_kv_blocks(engine_args: EngineArgs, model_config: ModelConfig, profile: StepTimeProfile) -> int:
    """The KV blocks the simulated engine gets: --num-kv-blocks, else the KV memory over the
    profile's bytes per block (its machine's dtype), else over this model's at --dtype."""
    if engine_args.num_kv_blocks:
        return engine_args.num_kv_blocks
    if profile.kv_bytes_per_block:
        return engine_args.kv_cache_bytes // profile.kv_bytes_per_block
    per_token = kv_bytes_per_token(model_config, TORCH_DTYPES[engine_args.dtype])
    return num_blocks_for_memory(per_token, engine_args.kv_cache_bytes, engine_args.block_size)


def parse_pd(text: str) -> tuple[int, int]:
    """`--pd P:D`: P prefill instances and D decode instances."""
    parts = text.split(":")
    try:
        shape = tuple(int(part) for part in parts)
    except ValueError:
        shape = ()
    if len(shape) != 2 or min(shape) < 1:
        raise InvalidRequestError(f"--pd must be P:D with P prefill and D decode instances, each at least 1 "
                                  f"(e.g. 1:3), got {text!r}")
    return shape


@dataclass
class SimRun:
    results: list[RequestResult]
    replicas: list[Replica]  # the engines the client's results come from (decode instances with --pd)
    wall_s: float
    prefill: list[Replica] = dataclasses.field(default_factory=list)
    link: KVLink | None = None

    @property
    def engines(self) -> list[Replica]:
        return [*self.prefill, *self.replicas]

    @property
    def simulated_s(self) -> float:
        return max(r.clock.now for r in self.engines) - min(r.send_time for r in self.results)

    def step_records(self) -> list[dict[str, Any]]:
        """Every engine's step records (`--trace-steps` lines), with `replica` when several (and
        `role`, prefill or decode, with --pd)."""
        lines = []
        named = [(f"prefill-{i}", "prefill", r) for i, r in enumerate(self.prefill)]
        named += [(i, "decode" if self.prefill else None, r) for i, r in enumerate(self.replicas)]
        for name, role, replica in named:
            for record in replica.core.step_records:
                line = record.to_dict()
                if len(self.engines) > 1:
                    line["replica"] = name
                if role is not None:
                    line["role"] = role
                lines.append(line)
        return lines


def simulate(requests: list[SimRequest], engine_args: EngineArgs, profile: StepTimeProfile | None = None,
             replicas: int = 1, router: str = "round-robin",
             replay: list[dict[str, Any]] | None = None, start_time: float = 0.0, record_steps: bool = False,
             on_finished: Callable[[], None] | None = None, pd: tuple[int, int] | None = None,
             link: LinkModel | None = None, draft_acceptance_rate: float | None = None) -> SimRun:
    """Serve `requests` on `replicas` simulated engines of `engine_args`, steps timed by
    `profile` (residuals drawn by `engine_args.seed`, the run's one seed) or, with `replay`, by a
    recorded run's step records
    (one replica; its clock starts at `start_time`, the recorded run's first step). `pd` (P, D):
    P prefill and D decode instances of `engine_args` instead, their KV over `link`. With
    n-gram speculative decoding, drafts hold at `draft_acceptance_rate` (default: the profile's)."""
    check_simulable(engine_args)
    if (profile is None) == (replay is None):
        raise InvalidRequestError("a simulation needs a step-time profile, or a recorded run to replay")
    if replay is not None and (replicas != 1 or pd is not None):
        raise InvalidRequestError("a replay runs one replica: the recorded run's")
    if pd is not None and replicas != 1:
        raise InvalidRequestError("give --replicas or --pd P:D, not both (--pd's D decode instances are the replicas)")
    if pd is not None and link is None:
        raise InvalidRequestError("--pd needs the KV link between the instances: a profile with kv_link "
                                  "(chunkserve profile --measure-link) or --kv-link-gbps")
    model_config = load_model_config(resolve_model(engine_args.model))
    latencies = Latencies()
    if profile is not None:
        latencies = Latencies(profile.request_latency_s, profile.output_latency_s)
        blocks = num_kv_blocks(engine_args, model_config, profile)
    else:
        blocks = num_kv_blocks(engine_args, model_config, StepTimeProfile({}))

    text = None
    if engine_args.speculative_config is not None:
        rate = draft_acceptance_rate if draft_acceptance_rate is not None else (
            profile.draft_acceptance_rate if profile is not None else None)
        if rate is None:
            raise InvalidRequestError("simulating speculative decoding needs the drafts' acceptance rate: "
                                      "--draft-acceptance-rate, or a profile fitted on a run with drafts")
        text = SyntheticText(rate, model_config.vocab_size, engine_args.seed)

    def timer(index: int) -> ProfileTimer | ReplayTimer:
        return ReplayTimer(replay) if replay is not None else ProfileTimer(profile, (engine_args.seed, index))

    fleet, prefill, kv_link = [], [], None
    if pd is None:
        for index in range(replicas):
            fleet.append(Replica(engine_args, model_config, blocks, timer(index), latencies, start_time, record_steps,
                                 text=text))
    else:
        kv_link = KVLink(link, kv_block_bytes(engine_args, model_config, profile))
        prefill = [_pd_instance("prefill", index, kv_link, engine_args, model_config, blocks, timer(index),
                                latencies, start_time, text) for index in range(pd[0])]
        fleet = [_pd_instance("decode", index, kv_link, engine_args, model_config, blocks, timer(pd[0] + index),
                              latencies, start_time, text) for index in range(pd[1])]
    started = time.perf_counter()  # the simulator's own cost, reported; never part of simulated time
    results = run_fleet(requests, fleet, router, start_time, on_finished, prefill)
    return SimRun(results, fleet, time.perf_counter() - started, prefill, kv_link)


def _pd_instance(role: str, index: int, link: KVLink, engine_args: EngineArgs, model_config: ModelConfig,
                 blocks: int, timer: ProfileTimer, latencies: Latencies, start_time: float,
                 text: SyntheticText | None) -> Replica:
    """A prefill or decode instance: the engine's scheduler side of the disaggregation connector
    on the replica's clock, sim/disagg.py's worker side on the link. Leases never lapse (no
    instance dies here); the other deadlines are the flags'."""
    clock = VirtualClock(start_time)
    settings = dataclasses.replace(engine_args, disaggregation_mode=role)
    if role == "prefill":
        connector = SimPrefillConnector(link, prefill_name(index))
        scheduler_side = PrefillConnectorScheduler(engine_args.block_size, engine_args.disaggregation_bootstrap_timeout,
                                                   math.inf, clock=clock.time)
    else:
        connector = SimDecodeConnector(link, f"decode-{index}", engine_args.disaggregation_transfer_window)
        scheduler_side = DecodeConnectorScheduler(engine_args.block_size, engine_args.disaggregation_waiting_timeout,
                                                  clock=clock.time)
    return Replica(settings, model_config, blocks, timer, latencies, clock=clock, connector=connector,
                   kv_connector=scheduler_side, text=text)


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
            "pd": [len(run.prefill), len(run.replicas)] if run.prefill else None,
            "kv_link": run.link.model.describe() if run.link is not None else None,
            "kv_link_bytes": run.link.bytes_sent if run.link is not None else None,
            "steps": sum(len(r.core.step_records) for r in run.engines),
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

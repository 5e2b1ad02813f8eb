"""Where a decode step's time goes with many requests running: the worker's compute (batch
building, the model forward, the logits and the sampler) against the engine's own work
(scheduling and bookkeeping in the engine core, the per-request outputs in the front end).

128 requests (16-token prompts) are prefilled, then `--steps` pure decode steps of all 128
are timed, twice, from what the engine measures itself (nothing is patched or wrapped):

- on the model: `LLMEngine.step` as the offline front end runs it (timed here, around each
  call) and the engine core's part of it, its step record's `duration_s` (scheduling, the
  executor's step, `update_from_output`);
- on no model: the same requests through an `EngineCore` whose executor is the
  `SimulatedExecutor` (a made-up token per row, at no cost): its steps' `duration_s` is the
  engine core's scheduling and bookkeeping alone.

Then "front end" (the output processor: detokenizer, metrics) is `LLMEngine.step` less the
core's step, "engine core bookkeeping" is the simulated core's step, and the worker's step is
the core's step on the model less that bookkeeping. Engine overhead is everything but the worker.

    .venv/bin/python -m benchmarks.engine.engine_overhead [--requests 128] [--steps 40] [--model PATH]
    .venv/bin/python -m benchmarks.engine.engine_overhead --smoke --model TINY_MODEL   # seconds: does it run?
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from benchmarks.support import add_model_flag, add_smoke_flag  # benchmarks/support.py

from chunkserve import LLM, SamplingParams
from chunkserve.config import EngineArgs, resolve_model
from chunkserve.engine.core import EngineCore
from chunkserve.engine.messages import EngineCoreRequest
from chunkserve.executor.simulated import SimulatedExecutor
from chunkserve.model.loader import load_model_config

PROMPT_LEN = 16
BUDGET = 2048


def prompts(count: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(100, 49000) for _ in range(PROMPT_LEN)] for _ in range(count)]


def on_the_model(args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """Per measured decode step: LLMEngine.step's seconds and its core step's (the step record's)."""
    llm = LLM(args.model, max_num_batched_tokens=BUDGET, max_num_seqs=args.requests,
              kv_cache_memory_gb=0.25 if args.smoke else 1)
    engine = llm.engine
    params = SamplingParams(max_tokens=args.steps + 8, ignore_eos=True, temperature=0)
    for i, prompt in enumerate(prompts(args.requests)):
        engine.add_request(f"r{i}", prompt, params)
    while engine.get_stats().num_waiting or any(not r.is_decoding for r in engine.engine_core.scheduler.running):
        engine.step()
    front, core = [], []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        front.append(time.perf_counter() - start)
        record = engine.last_step_record
        assert record.num_decode_tokens == args.requests, "not a pure decode step of every request"
        core.append(record.duration_s)
    engine.shutdown()
    return front, core


def on_no_model(args: argparse.Namespace) -> list[float]:
    """Per measured decode step: the core step's seconds with the simulated executor."""
    blocks = args.requests * -(-(PROMPT_LEN + args.steps + 16) // 16) + 64
    executor = SimulatedExecutor(load_model_config(resolve_model(args.model)), blocks)
    core = EngineCore(EngineArgs(model=args.model, max_num_batched_tokens=BUDGET, max_num_seqs=args.requests,
                                 num_kv_blocks=blocks), executor)
    params = SamplingParams(max_tokens=args.steps + 8, ignore_eos=True, temperature=0)
    for i, prompt in enumerate(prompts(args.requests)):
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params, None, arrival_time=time.time()))
    while core.get_stats().num_waiting or any(not r.is_decoding for r in core.scheduler.running):
        core.step()
    durations = []
    for _ in range(args.steps):
        record = core.step().record
        assert record.num_decode_tokens == args.requests, "not a pure decode step of every request"
        durations.append(record.duration_s)
    core.shutdown()
    return durations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40)
    add_model_flag(parser)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.steps = 4, 3

    front, core = on_the_model(args)
    bookkeeping = on_no_model(args)
    step, core_step, core_alone = (statistics.median(times) for times in (front, core, bookkeeping))
    phases = {"worker (batch, forward, logits, sampling)": core_step - core_alone,
              "engine core bookkeeping (schedule, update)": core_alone,
              "front end (output processor)": step - core_step}
    print(f"{args.requests} running requests, {args.steps} decode steps, {1000 * step:.1f} ms per step (medians)")
    print(f"{'phase':<44}{'ms/step':>9}{'share':>8}")
    for label, seconds in phases.items():
        print(f"{label:<44}{1000 * seconds:>9.2f}{100 * seconds / step:>7.1f}%")
    overhead = step - phases["worker (batch, forward, logits, sampling)"]
    print(f"{'engine overhead (all but the worker)':<44}{1000 * overhead:>9.2f}{100 * overhead / step:>7.1f}%")


if __name__ == "__main__":
    main()

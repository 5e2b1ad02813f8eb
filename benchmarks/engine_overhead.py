"""Where a decode step's time goes with many requests running: the model's forward and the
sampler's math against the engine's own work (scheduling, batch preparation, bookkeeping).

128 requests (16-token prompts) are prefilled, then `--steps` pure decode steps of all 128
are timed. Each phase is timed by wrapping the function that does it (a perf_counter pair
per call, about a microsecond): Scheduler.schedule, build_forward_batch, the model forward,
compute_logits, sample, Scheduler.update_from_output and the engine's per-request outputs
(the output processor: detokenizer, metrics). "other" is the rest of LLMEngine.step. Engine overhead is
everything but the forward, the logits and the sampler.

    .venv/bin/python benchmarks/engine_overhead.py [--requests 128] [--steps 40]
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from collections import defaultdict

from chunkserve import LLM, SamplingParams
from chunkserve.core.sched.scheduler import Scheduler
from chunkserve.engine.llm_engine import LLMEngine
from chunkserve.engine.output_processor import OutputProcessor
from chunkserve.model.llama import LlamaModel
from chunkserve.worker import model_runner

COMPUTE_PHASES = ("model forward", "compute_logits", "sample")


class PhaseTimer:
    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.active = False

    def wrap(self, owner: object, name: str, label: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if self.active:
                    self.totals[label] += time.perf_counter() - start

        setattr(owner, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    timer = PhaseTimer()
    timer.wrap(Scheduler, "schedule", "schedule")
    timer.wrap(Scheduler, "update_from_output", "update_from_output")
    timer.wrap(model_runner, "build_forward_batch", "build_forward_batch")
    timer.wrap(model_runner, "sample", "sample")
    timer.wrap(LlamaModel, "forward", "model forward")
    timer.wrap(LlamaModel, "compute_logits", "compute_logits")
    timer.wrap(OutputProcessor, "process_outputs", "outputs (detokenize, metrics)")
    timer.wrap(LLMEngine, "step", "step")

    llm = LLM(max_num_batched_tokens=2048, max_num_seqs=args.requests, kv_cache_memory_gb=1)
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.steps + 8, ignore_eos=True, temperature=0)
    for i in range(args.requests):
        engine.add_request(f"r{i}", [rng.randrange(100, 49000) for _ in range(16)], params)
    while engine.get_stats().num_waiting or any(not r.is_decoding for r in engine.engine_core.scheduler.running):
        engine.step()
    timer.active = True
    for _ in range(args.steps):
        engine.step()
        assert engine.last_step_record.num_decode_tokens == args.requests, "not a pure decode step of every request"
    timer.active = False

    step = timer.totals.pop("step")
    phases = dict(timer.totals)
    phases["other (rest of LLMEngine.step)"] = step - sum(phases.values())
    print(f"{args.requests} running requests, {args.steps} decode steps, {1000 * step / args.steps:.1f} ms per step")
    print(f"{'phase':<34}{'ms/step':>9}{'share':>8}")
    for label, seconds in sorted(phases.items(), key=lambda item: -item[1]):
        print(f"{label:<34}{1000 * seconds / args.steps:>9.2f}{100 * seconds / step:>7.1f}%")
    overhead = step - sum(phases[p] for p in COMPUTE_PHASES)
    print(f"{'engine overhead (all but compute)':<34}{1000 * overhead / args.steps:>9.2f}{100 * overhead / step:>7.1f}%")


if __name__ == "__main__":
    main()

"""Where a decode step's time goes with many requests running: the worker's compute (batch
building, the model forward, the logits and the sampler) against the engine's own work
(scheduling, bookkeeping, the per-request outputs).

128 requests (16-token prompts) are prefilled, then `--steps` pure decode steps of all 128
are timed, from what the engine measures itself (nothing is patched or wrapped):

- `LLMEngine.step`: the whole step as the offline front end runs it (timed here, around each call);
- the engine core's step: its step record's `duration_s` (scheduling, the executor's step and
  `update_from_output`);
- the worker's step: `EngineCore.time_synthetic_step` of the same shape (128 decodes at the
  steps' median context), run `--steps` times once the requests are done: what the runner
  spends on one such step with no scheduler around it (batch building, forward, logits, sampling).

Then "engine core bookkeeping" is the core's step less the worker's, and "front end" is
`LLMEngine.step` less the core's step: the output processor (detokenizer, metrics). Engine
overhead is everything but the worker's step.

    .venv/bin/python benchmarks/engine_overhead.py [--requests 128] [--steps 40] [--model PATH]
    .venv/bin/python benchmarks/engine_overhead.py --smoke --model TINY_MODEL   # seconds: does it run?
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from support import add_model_flag, add_smoke_flag  # benchmarks/support.py

from chunkserve import LLM, SamplingParams

PROMPT_LEN = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40)
    add_model_flag(parser)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.steps = 4, 3

    llm = LLM(args.model, max_num_batched_tokens=2048, max_num_seqs=args.requests,
              kv_cache_memory_gb=0.25 if args.smoke else 1)
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(max_tokens=args.steps + 8, ignore_eos=True, temperature=0)
    for i in range(args.requests):
        engine.add_request(f"r{i}", [rng.randrange(100, 49000) for _ in range(PROMPT_LEN)], params)
    while engine.get_stats().num_waiting or any(not r.is_decoding for r in engine.engine_core.scheduler.running):
        engine.step()

    front, core, contexts = [], [], []
    for _ in range(args.steps):
        contexts.append(statistics.median(r.num_tokens - 1 for r in engine.engine_core.scheduler.running))
        start = time.perf_counter()
        engine.step()
        front.append(time.perf_counter() - start)
        record = engine.last_step_record
        assert record.num_decode_tokens == args.requests, "not a pure decode step of every request"
        core.append(record.duration_s)
    while engine.has_unfinished_requests():
        engine.step()

    context = int(statistics.median(contexts))
    rows = [(context, 1)] * args.requests
    engine.engine_core.time_synthetic_step(rows)  # warm-up
    worker = [engine.engine_core.time_synthetic_step(rows, seed=i) for i in range(args.steps)]

    step, core_step, worker_step = (statistics.median(times) for times in (front, core, worker))
    phases = {"worker (batch, forward, logits, sampling)": worker_step,
              "engine core bookkeeping (schedule, update)": core_step - worker_step,
              "front end (output processor)": step - core_step}
    print(f"{args.requests} running requests, {args.steps} decode steps at context ~{context}, "
          f"{1000 * step:.1f} ms per step (medians)")
    print(f"{'phase':<44}{'ms/step':>9}{'share':>8}")
    for label, seconds in phases.items():
        print(f"{label:<44}{1000 * seconds:>9.2f}{100 * seconds / step:>7.1f}%")
    overhead = step - worker_step
    print(f"{'engine overhead (all but the worker)':<44}{1000 * overhead:>9.2f}{100 * overhead / step:>7.1f}%")


if __name__ == "__main__":
    main()

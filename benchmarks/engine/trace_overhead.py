"""What the step trace (`chunkserve serve --trace-steps FILE`) costs per engine step.

The trace writer runs after every step on the thread that receives the engine's events
(the engine thread itself with --disable-frontend-multiprocessing, where its cost adds to
every step). This times `StepTraceWriter.observe` on realistic step records written to a real
file, and prints the cost per step next to the duration of the fastest step our engine
runs (a batch-1 decode step of the default model, about 30-40 ms on 2 cores; see
docs/benchmarks-log.md).

    .venv/bin/python -m benchmarks.engine.trace_overhead [--steps 20000] [--smoke]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from benchmarks.support import add_smoke_flag  # benchmarks/support.py

from chunkserve.core.messages import ForwardMode
from chunkserve.core.stats import SchedulerStats
from chunkserve.engine.outputs import StepRecord
from chunkserve.entrypoints.server.trace import StepTraceWriter

REFERENCE_STEP_MS = 34.0  # batch-1 decode step, docs/benchmarks-log.md (29.1 tok/s)


def records(count: int) -> list[StepRecord]:
    modes = [ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.EXTEND]
    return [
        StepRecord(step_id=i, start_time=1.79e9 + i * 0.035, duration_s=0.0351234 + i * 1e-7,
                   predicted_duration_s=0.0342 + i * 1e-7, prediction_error_p50=0.031, prediction_error_p90=0.087,
                   slo_margin=1.25, prefill_wait_guard=False,
                   forward_mode=modes[i % 3], num_prefill_tokens=(i * 37) % 512, num_decode_tokens=i % 64,
                   num_requests=1 + i % 64, num_preemptions=0, kv_cache_usage=(i % 100) / 100,
                   prefix_cache_queries=(i * 37) % 512 if i % 3 else 0, prefix_cache_hits=(i * 16) % 256 if i % 3 else 0,
                   prefix_cache_hit_rate=0.25)
        for i in range(count)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.repeats = 200, 1
    busy = SchedulerStats(num_running=8, num_waiting=0, num_preempted_waiting=0, num_free_blocks=100,
                          num_blocks=200, num_preemptions_total=0, prefix_cache_queries_total=0,
                          prefix_cache_hits_total=0)
    steps = records(args.steps)
    per_step_us = []
    with tempfile.TemporaryDirectory() as folder:
        for repeat in range(args.repeats):
            writer = StepTraceWriter(os.path.join(folder, f"trace-{repeat}.jsonl"))
            start = time.perf_counter()
            for record in steps:
                writer.observe(record, [], busy)
            writer.close()
            per_step_us.append((time.perf_counter() - start) / len(steps) * 1e6)
        size = os.path.getsize(os.path.join(folder, "trace-0.jsonl"))
    median = statistics.median(per_step_us)
    print(f"trace cost per step: median {median:.1f} us over {args.repeats} runs of {args.steps} steps "
          f"(min {min(per_step_us):.1f}, max {max(per_step_us):.1f})")
    print(f"line size: {size / len(steps):.0f} bytes per step")
    print(f"share of a {REFERENCE_STEP_MS:.0f} ms decode step: {median / (REFERENCE_STEP_MS * 1000):.4%}")


if __name__ == "__main__":
    main()

"""Why the engine core runs in a process of its own: what another thread of the engine's
process costs its steps, against another process doing the same.

The engine steps 8 decode streams (64-token prompts, greedy, fixed output length) three
ways, in turn, for several rounds (the host drifts within minutes, so compare within a
round): alone on the main thread; on a thread while the main thread wakes every millisecond
(as an event loop serving streams does); and alone while a separate process wakes every
millisecond. It prints the median 8-row decode step of each run. Each torch op of a step
releases the GIL and must win it back on its way out, so a busy neighbour thread stalls
the step; a neighbour process only shares the cores.

    .venv/bin/python -m benchmarks.engine.gil_contention [--rounds 3] [--output-len 128] [--model PATH]
    .venv/bin/python -m benchmarks.engine.gil_contention --smoke --model TINY_MODEL   # seconds: does it run?
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time

from benchmarks.support import add_model_flag, add_smoke_flag  # benchmarks/support.py

from chunkserve import SamplingParams
from chunkserve.config import EngineArgs
from chunkserve.engine.llm_engine import LLMEngine

WAKER = "import time\nwhile True: time.sleep(0.001)"
MODES = ("alone", "beside a waking thread", "beside a waking process")


def decode_step_ms(engine: LLMEngine, mode: str, streams: int, output_len: int) -> float:
    params = SamplingParams(max_tokens=output_len, min_tokens=output_len, temperature=0.0)
    for i in range(streams):
        engine.add_request(f"{mode}-{i}", [100 + 7 * i + j for j in range(64)], params)
    first = len(engine.step_records)

    def run() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    if mode == "beside a waking thread":
        stepper = threading.Thread(target=run)
        stepper.start()
        while stepper.is_alive():
            time.sleep(0.001)
    elif mode == "beside a waking process":
        waker = subprocess.Popen([sys.executable, "-c", WAKER])
        try:
            run()
        finally:
            waker.kill()
            waker.wait()
    else:
        run()
    steps = [r.duration_s * 1000 for r in list(engine.step_records)[first:]
             if r.num_prefill_tokens == 0 and r.num_decode_tokens == streams]
    return statistics.median(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=128)
    add_model_flag(parser)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.streams, args.output_len = 1, 2, 8
    engine = LLMEngine(EngineArgs(model=args.model, kv_cache_memory_gb=0.25 if args.smoke else 1,
                                  max_num_batched_tokens=256))
    decode_step_ms(engine, "alone", args.streams, 16)  # warm-up
    results: dict[str, list[float]] = {mode: [] for mode in MODES}
    print(f"| round | {' | '.join(MODES)} |")
    print(f"|---|{'---|' * len(MODES)}")
    for round_index in range(1, args.rounds + 1):
        for mode in MODES:
            results[mode].append(decode_step_ms(engine, mode, args.streams, args.output_len))
        print(f"| {round_index} | {' | '.join(f'{results[m][-1]:.1f} ms' for m in MODES)} |", flush=True)
    medians = {m: statistics.median(results[m]) for m in MODES}
    print(f"| median | {' | '.join(f'{medians[m]:.1f} ms' for m in MODES)} |")
    ratios = " | ".join(f"{medians[m] / medians['alone']:.2f}x" for m in MODES)
    print(f"| ratio to alone | {ratios} |")


if __name__ == "__main__":
    main()

"""Whole engine steps with the layers' oneDNN-packed weights on and off (in-process, the
default model): what `ONEDNN_MIN_ROWS` buys per step shape. Each shape is timed `--repeats`
times, alternating the two, with `EngineCore.time_synthetic_step`; medians are printed. With
`--dtype bfloat16` the packed weights are bfloat16 and "off" is the GGUF blocks' C++ kernel at
every row count: what `BF16_ONEDNN_MIN_ROWS` buys.

    .venv/bin/python -m benchmarks.engine.onednn_steps [--repeats 5] [--dtype bfloat16] [--model PATH]
    .venv/bin/python -m benchmarks.engine.onednn_steps --smoke --model TINY_MODEL   # two small steps, once: does it run?
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.support import add_model_flag, add_smoke_flag  # benchmarks/support.py

from chunkserve.config import EngineArgs
from chunkserve.engine.llm_engine import LLMEngine
from chunkserve.model.llama import Linear

# name -> (start position, tokens) per request, as time_synthetic_step takes them
SHAPES = {
    "1 decode": [(256, 1)],
    "2 decodes": [(256, 1)] * 2,
    "3 decodes": [(256, 1)] * 3,
    "4 decodes": [(256, 1)] * 4,
    "8 decodes": [(256, 1)] * 8,
    "a 32-token chunk": [(0, 32)],
    "a 48-token chunk": [(0, 48)],
    "a 64-token chunk": [(0, 64)],
    "64 decodes at context 300": [(300, 1)] * 64,
    "a 256-token chunk": [(0, 256)],
    "8 decodes + a 248-token chunk at context 1024": [(256, 1)] * 8 + [(1024, 248)],
    "a 512-token chunk": [(0, 512)],
}
SMOKE_SHAPES = {"2 decodes": [(16, 1)] * 2, "a 16-token chunk": [(0, 16)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    add_model_flag(parser)
    add_smoke_flag(parser)
    args = parser.parse_args()
    shapes, repeats = (SMOKE_SHAPES, 1) if args.smoke else (SHAPES, args.repeats)
    engine = LLMEngine(EngineArgs(model=args.model, kv_cache_memory_gb=0.25 if args.smoke else 1,
                                  max_num_batched_tokens=512, dtype=args.dtype))
    model = engine.engine_core.executor.worker.runner.model
    layers = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
    packed = [layer.packed for layer in layers]
    if any(p is None for p in packed):
        raise SystemExit("the layers are not packed here (no C++ ops or no oneDNN): nothing to compare")
    print("| step | before | oneDNN | ratio |")
    print("|---|---|---|---|")
    for name, rows in shapes.items():
        times: dict[bool, list[float]] = {True: [], False: []}
        for repeat in range(repeats):
            for use_packed in (True, False):
                for layer, weight in zip(layers, packed):
                    layer.packed = weight if use_packed else None
                times[use_packed].append(engine.engine_core.time_synthetic_step(rows, seed=repeat) * 1000)
        on, off = statistics.median(times[True]), statistics.median(times[False])
        print(f"| {name} | {off:.1f} ms | {on:.1f} ms | {on / off:.2f} |", flush=True)


if __name__ == "__main__":
    main()

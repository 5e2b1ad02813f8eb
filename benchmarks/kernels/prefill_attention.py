"""A prefill chunk's attention: the C++ op reading the paged KV in place
(csrc/prefill_attention.cpp) against the plain-torch path (gather the chunk's keys, SDPA with
its causal mask), through `paged_attention` itself.

SmolLM2-135M's heads (9 query heads, 3 kv heads of 64), 16-slot blocks scattered at random
over the pool, one layer; the chunk shapes of issue 5's prefill target (a 2048-token prompt
whole, and in 512-token chunks) and Scenario A's 256-token prompts. Each shape runs both
paths alternately `--rounds` times; the medians are printed with the rate on the attended
(query, key) pairs (4 * heads * head_dim FLOPs each: q.k and p.v), and both must agree. With
`--deterministic`, deterministic mode's op (`attention_kernels(deterministic=True)`) runs as a
third path, and its time against the default C++ op is printed.

    .venv/bin/python -m benchmarks.kernels.prefill_attention [--rounds 7] [--deterministic] [--smoke]
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np
import torch
from benchmarks.support import add_smoke_flag, timed  # benchmarks/support.py

from chunkserve.attention.paged import paged_attention
from chunkserve.core.messages import ScheduledRequest
from chunkserve.core.step_predictor import chunk_attention
from chunkserve.ops.cpp_ops import build_cpp_ops
from chunkserve.worker.input_batch import build_forward_batch


def tables_of(scheduled: list[ScheduledRequest]) -> dict[str, np.ndarray]:
    return {s.request_id: np.asarray(s.new_block_ids, dtype=np.int64) for s in scheduled}

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, POOL_BLOCKS = 9, 3, 64, 16, 1024
SHAPES = [(256, 0), (2048, 0), (512, 0), (512, 512), (512, 1024), (512, 1536)]  # (chunk tokens, start)
SMOKE_SHAPES = [(16, 0), (16, 32)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--deterministic", action="store_true", help="also time deterministic mode's op")
    add_smoke_flag(parser)
    args = parser.parse_args()
    rounds = 1 if args.smoke else args.rounds
    ops = build_cpp_ops()
    generator = torch.Generator().manual_seed(0)
    k_cache = torch.randn(POOL_BLOCKS * BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=generator)
    v_cache = torch.randn(POOL_BLOCKS * BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=generator)
    blocks = np.random.default_rng(0).permutation(POOL_BLOCKS).tolist()
    scale = HEAD_DIM**-0.5
    print(f"{torch.get_num_threads()} threads; heads {HEADS}/{KV_HEADS} x {HEAD_DIM}, blocks of {BLOCK_SIZE}")
    deterministic = ("| deterministic ms | deterministic / in place ", "|---|---") if args.deterministic else ("", "")
    print("| chunk (tokens @ start) | torch gather + SDPA ms | C++ in place ms | in place / torch | "
          f"GFLOP/s torch | GFLOP/s in place {deterministic[0]}|")
    print(f"|---|---|---|---|---|---{deterministic[1]}|")
    for count, start in SMOKE_SHAPES if args.smoke else SHAPES:
        table = blocks[: -(-(start + count) // BLOCK_SIZE)]
        scheduled = [ScheduledRequest("r", start, count, table, True, True, False)]
        tokens = {"r": [0] * (start + count)}
        q = torch.randn(count, HEADS, HEAD_DIM, generator=generator)
        paths = {
            "torch": build_forward_batch(scheduled, tokens, tables_of(scheduled), BLOCK_SIZE).attn,
            "in place": build_forward_batch(scheduled, tokens, tables_of(scheduled), BLOCK_SIZE, ops.attention_kernels()).attn,
        }
        if args.deterministic:
            paths["deterministic"] = build_forward_batch(scheduled, tokens, tables_of(scheduled), BLOCK_SIZE,
                                                         ops.attention_kernels(deterministic=True)).attn
        outputs = {name: paged_attention(q, k_cache, v_cache, meta, scale) for name, meta in paths.items()}
        for name in paths:
            torch.testing.assert_close(outputs[name], outputs["torch"], rtol=1e-4, atol=1e-4)
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(rounds):
            for name, meta in paths.items():
                times[name].append(timed(lambda: paged_attention(q, k_cache, v_cache, meta, scale)))
        medians = {name: statistics.median(samples) for name, samples in times.items()}
        flop = 4 * HEADS * HEAD_DIM * chunk_attention(start, count)
        extra = f" {medians['deterministic'] * 1e3:.2f} | {medians['deterministic'] / medians['in place']:.2f}x |" \
            if args.deterministic else ""
        print(f"| {count} @ {start} | {medians['torch'] * 1e3:.2f} | {medians['in place'] * 1e3:.2f} | "
              f"{medians['in place'] / medians['torch']:.2f}x | {flop / medians['torch'] / 1e9:.0f} | "
              f"{flop / medians['in place'] / 1e9:.0f} |{extra}")


if __name__ == "__main__":
    main()

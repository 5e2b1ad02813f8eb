"""Where an offline run's time goes: the engine's wall time split by op.

Runs `--num-prompts` random prompts of `--input-len` tokens, `--output-len` greedy output
tokens each, all submitted at once (Scenario A's shape by default), through the offline `LLM`
with the C++ ops, and sums the time spent in each of the model's ops (`ModelOps`: the linear
layers, the LM head, the norms...), in decode attention (the C++ op), in the prefill chunks'
SDPA, in writing the KV, in sampling and in building the batch. It also counts the linear
layers' FLOPs, so their sustained GFLOP/s can be set against `torch.mm`'s peak measured
right before and after (the best of 3 products of two 2048 x 2048 matrices).

Timers wrap Python calls (perf_counter around each), so they add a few microseconds per
call; the wall time is the run's, timers included.

    .venv/bin/python benchmarks/op_time.py [--budget 256] [--num-prompts 64] [--input-len 256] [--output-len 64]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import time
from collections.abc import Callable

import numpy as np
from engine_speed import gemm_peak_gflop_s  # benchmarks/, the script's own folder

import chunkserve.model.llama as llama
import chunkserve.worker.model_runner as model_runner
from chunkserve import LLM, SamplingParams
from chunkserve.worker import attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--budget", type=int, default=256, help="--max-num-batched-tokens")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()

    llm = LLM(max_num_batched_tokens=args.budget, kv_cache_memory_gb=1, op_backend="cpp")
    runner = llm.engine.runner
    seconds: dict[str, float] = collections.defaultdict(float)
    linear_flop = [0.0]

    def timed(name: str, function: Callable) -> Callable:
        def wrapper(*call_args, **kwargs):
            start = time.perf_counter()
            result = function(*call_args, **kwargs)
            seconds[name] += time.perf_counter() - start
            return result
        return wrapper

    def counted(function: Callable) -> Callable:
        def wrapper(x, weight, *rest):
            linear_flop[0] += 2 * x.shape[0] * weight.shape[0] * weight.shape[1]
            return function(x, weight, *rest)
        return wrapper

    ops = runner.cpp_ops.model_ops()
    timed_ops = {field.name: timed(field.name, getattr(ops, field.name)) for field in dataclasses.fields(ops)}
    timed_ops["linear"] = counted(timed_ops["linear"])
    runner.model.set_ops(dataclasses.replace(ops, **timed_ops))
    runner.decode_kernel = timed("decode attention (C++)", runner.decode_kernel)
    attention.F.scaled_dot_product_attention = timed("prefill attention (SDPA)",
                                                     attention.F.scaled_dot_product_attention)
    llama.write_kv = timed("write KV", llama.write_kv)
    model_runner.sample = timed("sample", model_runner.sample)
    model_runner.build_forward_batch = timed("build batch", model_runner.build_forward_batch)

    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, args.input_len).tolist() for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0), use_tqdm=False)
    seconds.clear()
    linear_flop[0] = 0.0
    peak_before = gemm_peak_gflop_s(repeats=3)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    peak_after = gemm_peak_gflop_s(repeats=3)

    print(f"{args.num_prompts} prompts x {args.input_len} in, {args.output_len} out, budget {args.budget}: "
          f"{wall:.1f} s, {args.num_prompts * args.output_len / wall:.1f} output tok/s")
    print(f"torch.mm 2048^3 peak: {peak_before:.0f} GFLOP/s before, {peak_after:.0f} after")
    for name, total in sorted(seconds.items(), key=lambda item: -item[1]):
        print(f"  {name:26s} {total:7.2f} s  {100 * total / wall:5.1f}%")
    rate = linear_flop[0] / seconds["linear"] / 1e9
    print(f"  linear layers: {linear_flop[0] / 1e12:.2f} TFLOP at {rate:.0f} GFLOP/s")


if __name__ == "__main__":
    main()

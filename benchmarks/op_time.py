"""Where an offline run's time goes: the engine's wall time split by op.

Runs `--num-prompts` random prompts of `--input-len` tokens, `--output-len` greedy output
tokens each, all submitted at once (Scenario A's shape by default), through the offline `LLM`
with the C++ ops, and sums the time spent in each of the model's ops (`ModelOps`: the linear
layers, the LM head, the norms...), in decode attention and the prefill chunks' attention (the
C++ ops), in writing the KV, in sampling and in building the batch. It counts the work each
heavy op must do (the FLOPs of the linear layers, the LM head and the prefill attention's
attended pairs; the KV bytes decode attention reads) and its rate, set against `torch.mm`'s
peak (the best of 3 products of two 2048 x 2048 matrices) and the streaming read rate (a sum
over 1 GiB), measured right around the run.

From those it prints the run's floor: the time if every FLOP ran at the best GEMM rate seen
and every decode KV byte came at the streaming read rate, with nothing else to do (no norms,
no sampling, no server). No float32 engine can run this workload on this machine faster;
issue 5's Scenario A throughput target is set against it in docs/benchmarks-log.md.

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
from engine_speed import gemm_peak_gflop_s, memory_read_gb_s  # benchmarks/, the script's own folder

import chunkserve.model.llama as llama
import chunkserve.worker.model_runner as model_runner
from chunkserve import LLM, SamplingParams
from chunkserve.core.step_predictor import chunk_attention
from chunkserve.ops.cpp_ops import AttentionKernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--budget", type=int, default=256, help="--max-num-batched-tokens")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()

    llm = LLM(max_num_batched_tokens=args.budget, kv_cache_memory_gb=1, op_backend="cpp")
    runner = llm.engine.engine_core.executor.worker.runner
    seconds: dict[str, float] = collections.defaultdict(float)
    work: dict[str, float] = collections.defaultdict(float)  # FLOPs, or bytes read for decode attention

    def timed(name: str, function: Callable) -> Callable:
        def wrapper(*call_args, **kwargs):
            start = time.perf_counter()
            result = function(*call_args, **kwargs)
            seconds[name] += time.perf_counter() - start
            return result
        return wrapper

    def counted(name: str, function: Callable) -> Callable:
        def wrapper(x, weight, *rest):
            work[name] += 2 * x.shape[0] * weight.shape[0] * weight.shape[1]
            return function(x, weight, *rest)
        return wrapper

    def counted_decode(function: Callable) -> Callable:
        def wrapper(q, k_cache, v_cache, block_tables, context_lens, *rest):
            slot_bytes = k_cache.shape[1] * k_cache.shape[2] * k_cache.element_size()
            work["decode attention (C++)"] += 2 * slot_bytes * int(context_lens.sum())  # K and V, read once
            return function(q, k_cache, v_cache, block_tables, context_lens, *rest)
        return wrapper

    def counted_prefill(function: Callable) -> Callable:
        def wrapper(q, k_cache, v_cache, block_table, start, *rest):
            rows, heads, head_dim = q.shape
            work["prefill attention (C++)"] += 4 * heads * head_dim * chunk_attention(start, rows)  # q.k and p.v
            return function(q, k_cache, v_cache, block_table, start, *rest)
        return wrapper

    ops = runner.cpp_ops.model_ops()
    timed_ops = {field.name: timed(field.name, getattr(ops, field.name)) for field in dataclasses.fields(ops)}
    for name in ("linear", "logits"):
        timed_ops[name] = counted(name, timed_ops[name])
    runner.model.set_ops(dataclasses.replace(ops, **timed_ops))
    kernels = runner.attention_kernels
    runner.attention_kernels = AttentionKernels(
        decode=counted_decode(timed("decode attention (C++)", kernels.decode)),
        prefill=counted_prefill(timed("prefill attention (C++)", kernels.prefill)))
    llama.write_kv = timed("write KV", llama.write_kv)
    model_runner.sample = timed("sample", model_runner.sample)
    model_runner.build_forward_batch = timed("build batch", model_runner.build_forward_batch)

    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, args.input_len).tolist() for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0), use_tqdm=False)
    seconds.clear()
    work.clear()
    peak_before = gemm_peak_gflop_s(repeats=3)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    peak_after = gemm_peak_gflop_s(repeats=3)

    print(f"{args.num_prompts} prompts x {args.input_len} in, {args.output_len} out, budget {args.budget}: "
          f"{wall:.1f} s, {args.num_prompts * args.output_len / wall:.1f} output tok/s")
    read_rate = memory_read_gb_s(repeats=3)
    print(f"torch.mm 2048^3 peak: {peak_before:.0f} GFLOP/s before, {peak_after:.0f} after; "
          f"memory read (sum of 1 GiB): {read_rate:.1f} GB/s")
    for name, total in sorted(seconds.items(), key=lambda item: -item[1]):
        rate = ""
        if name == "decode attention (C++)":
            rate = f"{work[name] / 1e9:8.1f} GB read at {work[name] / total / 1e9:5.1f} GB/s"
        elif name in work:
            rate = f"{work[name] / 1e12:8.2f} TFLOP at {work[name] / total / 1e9:5.0f} GFLOP/s"
        print(f"  {name:26s} {total:7.2f} s  {100 * total / wall:5.1f}%  {rate}")

    # The run's floor: every FLOP at the best GEMM rate seen (torch.mm's or the linear layers' own,
    # whichever is higher) and the decodes' KV bytes at the streaming read rate.
    peak = max(peak_before, peak_after, work["linear"] / seconds["linear"] / 1e9) * 1e9
    floor = sum(total for name, total in work.items() if name != "decode attention (C++)") / peak \
        + work["decode attention (C++)"] / (read_rate * 1e9)
    print(f"floor (the linear, LM head and prefill attention FLOPs at {peak / 1e9:.0f} GFLOP/s, the decode KV at "
          f"{read_rate:.1f} GB/s): {floor:.1f} s, {args.num_prompts * args.output_len / floor:.1f} output tok/s; "
          f"this run took {wall / floor:.2f}x the floor")


if __name__ == "__main__":
    main()

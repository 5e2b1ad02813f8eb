"""Where an offline run's time goes: the engine's wall time split by op.

Runs `--num-prompts` random prompts of `--input-len` tokens, `--output-len` greedy output
tokens each, all submitted at once (Scenario A's shape by default), through the offline `LLM`
with the C++ ops, and sums the time spent in each of the model's ops (`ModelOps`: the linear
layers, the LM head, the norms, the fused decoder layer of decode steps...) and in decode
attention and the prefill chunks' attention (the C++ ops). The ops are timed where the model
takes them from: every module's `ops` (what `LlamaModel.set_ops` installs) and the runner's
attention kernels are replaced by the same functions with a perf_counter pair around each call
(a few microseconds per call, included in the wall time); nothing else is patched. The rest of
the engine's steps (batch building, KV writes, sampling, scheduling) is the step records' summed
`duration_s` less the ops' time; what is outside the steps (the front end: detokenizer,
outputs) is the wall time less the steps'.

It counts the work each heavy op must do (the FLOPs of the linear layers, the LM head, the fused
decode layers' linears and the prefill attention's attended pairs; the KV bytes decode attention
reads) and its rate, set against `torch.mm`'s peak (the best of 3 products of two 2048 x 2048
matrices) and the streaming read rate (a sum over 1 GiB), measured right around the run.

From those it prints the run's floor: the time if every FLOP ran at the best GEMM rate seen
and every decode KV byte came at the streaming read rate, with nothing else to do (no norms,
no sampling, no server). No float32 engine can run this workload on this machine faster;
issue 5's Scenario A throughput target is set against it in docs/benchmarks-log.md.

    .venv/bin/python -m benchmarks.engine.op_time [--budget 256] [--num-prompts 64] [--input-len 256] [--output-len 64]
    .venv/bin/python -m benchmarks.engine.op_time --smoke --model TINY_MODEL   # seconds: does it run?
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import time
from collections.abc import Callable

import numpy as np
from benchmarks.support import add_model_flag, add_smoke_flag, gemm_peak_gflop_s, memory_read_gb_s  # benchmarks/support.py

from chunkserve import LLM, SamplingParams
from chunkserve.core.step_predictor import chunk_attention
from chunkserve.model.config import ModelConfig
from chunkserve.model.llama import UsesOps
from chunkserve.ops.cpp_ops import AttentionKernels

DECODE_ATTENTION, PREFILL_ATTENTION = "decode attention (C++)", "prefill attention (C++)"
DECODE_LAYER = "decoder_layers"
READ_WORK = (DECODE_ATTENTION, f"{DECODE_LAYER} KV")  # work in bytes read; the rest in FLOPs


class OpTimer:
    """Seconds per op and the work it did (FLOPs, or KV bytes read), summed over the calls."""

    def __init__(self, config: ModelConfig) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.work: dict[str, float] = collections.defaultdict(float)
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        # one decoder layer's linear weights (qkv, o, gate and up, down): 2 FLOPs per weight and row
        self.layer_weights = config.hidden_size * (q + 2 * kv) + q * config.hidden_size \
            + 3 * config.hidden_size * config.intermediate_size

    def clear(self) -> None:
        self.seconds.clear()
        self.work.clear()

    def timed(self, name: str, function: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            result = function(*args, **kwargs)
            self.seconds[name] += time.perf_counter() - start
            return result
        return wrapper

    def install(self, runner) -> None:
        """Every op the model and the runner call, timed (and the heavy ones counted)."""
        model = runner.model
        ops = next(m.ops for m in model.modules() if isinstance(m, UsesOps))
        timed = {f.name: self.timed(f.name, getattr(ops, f.name)) for f in dataclasses.fields(ops)
                 if callable(getattr(ops, f.name)) and not f.name.startswith("pack_")}
        for name in ("linear", "logits"):
            timed[name] = self._counted_linear(name, timed[name])
        if "decoder_layers" in timed:
            timed["decoder_layers"] = self._counted_decoder_layers(timed["decoder_layers"])
        ops = dataclasses.replace(ops, **timed)
        for module in model.modules():
            if isinstance(module, UsesOps):
                module.ops = ops
        kernels = runner.attention_kernels
        runner.attention_kernels = AttentionKernels(
            decode=self._counted_decode(self.timed(DECODE_ATTENTION, kernels.decode)),
            prefill=self._counted_prefill(self.timed(PREFILL_ATTENTION, kernels.prefill)))

    def _counted_linear(self, name: str, function: Callable) -> Callable:
        def wrapper(x, weight, *rest):
            self.work[name] += 2 * x.shape[0] * weight.shape[0] * weight.shape[1]
            return function(x, weight, *rest)
        return wrapper

    def _counted_decoder_layers(self, function: Callable) -> Callable:
        def wrapper(hidden, residual, cos, sin, k_caches, v_caches, slot_mapping, block_tables, context_lens, *rest):
            layers = len(k_caches)
            self.work[DECODE_LAYER] += 2 * hidden.shape[0] * self.layer_weights * layers
            slot_bytes = k_caches[0].shape[1] * k_caches[0].shape[2] * k_caches[0].element_size()
            self.work[f"{DECODE_LAYER} KV"] += 2 * slot_bytes * int(context_lens.sum()) * layers  # K and V, read once
            return function(hidden, residual, cos, sin, k_caches, v_caches, slot_mapping, block_tables, context_lens,
                            *rest)
        return wrapper

    def _counted_decode(self, function: Callable) -> Callable:
        def wrapper(q, k_cache, v_cache, block_tables, context_lens, *rest):
            slot_bytes = k_cache.shape[1] * k_cache.shape[2] * k_cache.element_size()
            self.work[DECODE_ATTENTION] += 2 * slot_bytes * int(context_lens.sum())  # K and V, read once
            return function(q, k_cache, v_cache, block_tables, context_lens, *rest)
        return wrapper

    def _counted_prefill(self, function: Callable) -> Callable:
        def wrapper(q, k_cache, v_cache, block_table, start, *rest):
            rows, heads, head_dim = q.shape
            self.work[PREFILL_ATTENTION] += 4 * heads * head_dim * chunk_attention(start, rows)  # q.k and p.v
            return function(q, k_cache, v_cache, block_table, start, *rest)
        return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--budget", type=int, default=256, help="--max-num-batched-tokens")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    add_model_flag(parser)
    add_smoke_flag(parser)
    args = parser.parse_args()
    peak_size, read_gib = 2048, 1.0
    if args.smoke:
        args.budget, args.num_prompts, args.input_len, args.output_len = 64, 4, 16, 4
        peak_size, read_gib = 256, 1 / 64

    llm = LLM(args.model, max_num_batched_tokens=args.budget, kv_cache_memory_gb=0.25 if args.smoke else 1,
              op_backend="cpp")
    timer = OpTimer(llm.engine.engine_core.model_config)
    timer.install(llm.engine.engine_core.executor.worker.runner)

    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, args.input_len).tolist() for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0), use_tqdm=False)
    timer.clear()
    peak_before = gemm_peak_gflop_s(repeats=3, size=peak_size)
    first = len(llm.get_step_records())
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    steps_s = sum(r.duration_s for r in llm.get_step_records()[first:])
    peak_after = gemm_peak_gflop_s(repeats=3, size=peak_size)

    seconds, work = dict(timer.seconds), dict(timer.work)
    print(f"{args.num_prompts} prompts x {args.input_len} in, {args.output_len} out, budget {args.budget}: "
          f"{wall:.1f} s, {args.num_prompts * args.output_len / wall:.1f} output tok/s")
    read_rate = memory_read_gb_s(repeats=3, gib=read_gib)
    print(f"torch.mm {peak_size}^3 peak: {peak_before:.0f} GFLOP/s before, {peak_after:.0f} after; "
          f"memory read (sum of {read_gib:g} GiB): {read_rate:.1f} GB/s")
    rows = {**seconds, "rest of the steps (batch, KV writes, sampling, scheduling)": steps_s - sum(seconds.values()),
            "outside the steps (front end: detokenizer, outputs)": wall - steps_s}
    width = max(len(name) for name in rows)
    for name, total in sorted(rows.items(), key=lambda item: -item[1]):
        parts = []
        if name == DECODE_ATTENTION and total > 0:
            parts.append(f"{work[name] / 1e9:8.1f} GB read at {work[name] / total / 1e9:5.1f} GB/s")
        elif name in work and total > 0:
            parts.append(f"{work[name] / 1e12:8.2f} TFLOP at {work[name] / total / 1e9:5.0f} GFLOP/s")
        if name == DECODE_LAYER:
            parts.append(f"{work.get(f'{DECODE_LAYER} KV', 0.0) / 1e9:.1f} GB of KV read")
        print(f"  {name:{width}s} {total:7.2f} s  {100 * total / wall:5.1f}%  {'; '.join(parts)}")

    # The run's floor: every FLOP at the best GEMM rate seen (torch.mm's or the linear layers' own,
    # whichever is higher) and the decodes' KV bytes at the streaming read rate.
    linear_rate = work["linear"] / seconds["linear"] / 1e9 if seconds.get("linear") else 0.0
    peak = max(peak_before, peak_after, linear_rate) * 1e9
    floor = sum(total for name, total in work.items() if name not in READ_WORK) / peak \
        + sum(work.get(name, 0.0) for name in READ_WORK) / (read_rate * 1e9)
    print(f"floor (the linear, LM head, decode layers' and prefill attention FLOPs at {peak / 1e9:.0f} GFLOP/s, the "
          f"decode KV at {read_rate:.1f} GB/s): {floor:.1f} s, {args.num_prompts * args.output_len / floor:.1f} "
          f"output tok/s; this run took {wall / floor:.2f}x the floor")


if __name__ == "__main__":
    main()

"""`--dtype float32` against `--dtype bfloat16`, in-process, on the default model.

Two offline engines (`LLM`, the C++ ops, no prefix caching), one per dtype, run in turn
`--repeats` times each, alternating:

* Scenario A: 64 random-token prompts of 256 tokens, 64 greedy output tokens each (EOS
  ignored), submitted at once at the default step budget; output tokens over the wall time of
  `generate`.
* decode-1 and decode-8: 1 and 8 requests of 64-token prompts decode 32 tokens together; the
  median duration of the steps that decode the whole batch (as benchmarks/engine/decode_step.py).

Medians over the repeats are printed, with the CPU's bfloat16 support (bfloat16 refuses to
start without it).

    .venv/bin/python -m benchmarks.engine.dtype_speed [--repeats 2] [--model PATH]
    .venv/bin/python -m benchmarks.engine.dtype_speed --smoke --model TINY_MODEL   # seconds (bfloat16 only where native)
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from benchmarks.support import add_model_flag, add_smoke_flag  # benchmarks/support.py

from chunkserve import LLM, SamplingParams
from chunkserve.config.cpu import native_bf16

DTYPES = ("float32", "bfloat16")
SCENARIO_A = (64, 256, 64)  # prompts, prompt tokens, output tokens
SMOKE_SCENARIO_A = (4, 16, 4)
DECODE_TOKENS = 32


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(count)]


def scenario_a_tok_s(llm: LLM, seed: int, shape: tuple[int, int, int] = SCENARIO_A) -> float:
    prompts, prompt_len, output_len = shape
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
    start = time.perf_counter()
    outputs = llm.generate(random_prompts(prompts, prompt_len, seed), params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def decode_step_ms(llm: LLM, batch: int, seed: int, tokens: int = DECODE_TOKENS) -> float:
    before = len(llm.get_step_records())
    llm.generate(random_prompts(batch, 64, seed), SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0),
                 use_tqdm=False)
    steps = [r for r in llm.get_step_records()[before:]
             if r.forward_mode.name == "DECODE" and r.num_decode_tokens == batch]
    return statistics.median(r.duration_s * 1000 for r in steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=2)
    add_model_flag(parser)
    add_smoke_flag(parser, "seconds on the smallest shapes (bfloat16 left out where the CPU lacks it): does it run?")
    args = parser.parse_args()
    capabilities = torch.cpu.get_capabilities()
    print(f"CPU {capabilities.get('cpu_name')}, torch capability {torch.backends.cpu.get_cpu_capability()}, "
          f"avx512_bf16 {capabilities.get('avx512_bf16')}, amx_bf16 {capabilities.get('amx_bf16')}")
    dtypes = DTYPES
    if args.smoke and not native_bf16():
        dtypes = ("float32",)
        print("bfloat16 left out: this CPU has no native bfloat16 (a full run refuses to start here)")
    shape, tokens, repeats = (SMOKE_SCENARIO_A, 4, 1) if args.smoke else (SCENARIO_A, DECODE_TOKENS, args.repeats)
    engines = {dtype: LLM(args.model, dtype=dtype, kv_cache_memory_gb=0.25 if args.smoke else 2,
                          enable_prefix_caching=False) for dtype in dtypes}
    metrics = {"Scenario A (out tok/s)": lambda llm, seed: scenario_a_tok_s(llm, seed, shape),
               "decode-1 step (ms)": lambda llm, seed: decode_step_ms(llm, 1, seed, tokens),
               "decode-8 step (ms)": lambda llm, seed: decode_step_ms(llm, 8, seed, tokens)}
    results: dict[tuple[str, str], list[float]] = {}
    for repeat in range(repeats):
        for name, measure in metrics.items():
            for dtype in dtypes:
                value = measure(engines[dtype], repeat)
                results.setdefault((name, dtype), []).append(value)
                print(f"repeat {repeat}: {name} {dtype} {value:.1f}", flush=True)
    print(f"{'metric':<24}{'float32':>10}{'bfloat16':>10}{'bf16/fp32':>11}   all runs (float32; bfloat16)")
    for name in metrics:
        if len(dtypes) < 2:
            print(f"{name:<24}{statistics.median(results[(name, 'float32')]):>10.1f}")
            continue
        fp32, bf16 = (results[(name, dtype)] for dtype in DTYPES)
        print(f"{name:<24}{statistics.median(fp32):>10.1f}{statistics.median(bf16):>10.1f}"
              f"{statistics.median(bf16) / statistics.median(fp32):>10.2f}x   "
              f"{', '.join(f'{v:.1f}' for v in fp32)}; {', '.join(f'{v:.1f}' for v in bf16)}")


if __name__ == "__main__":
    main()

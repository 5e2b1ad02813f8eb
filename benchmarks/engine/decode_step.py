"""Decode step time with the C++ ops (`--op-backend cpp`) vs plain torch.

For each scenario a batch of requests is prefilled, then decodes 32 tokens together; the
number is the median duration of the steps that decode the whole batch (pure decode steps),
the TBT a stream sees without interference. Scenarios: 1 and 8 requests at context 64, 8 at
context 1024, and 8 short (64) plus one long (2040) context. With torch the linear layers are
MKL's GEMM, attention gathers every decode's keys and values into a contiguous tensor each
step (grouped by context length), and norms, rotary and SiLU are chains of torch calls; with
cpp the small-batch linear kernel streams the weights once (the default GGUF's Q4_1 and Q8_0
blocks as they are), attention reads the KV in place through the block tables, and the small
ops are fused (chunkserve/ops/csrc/). Backends alternate, `--repeats` times each; the
median over repeats is shown.

`--cpu-isa avx2` runs the C++ ops' AVX2 kernels on an AVX-512 CPU (`set_cpu_isa`), as on the
AVX2-only hosts (with `--dtype float32`, what `--dtype auto` resolves to there); torch's own
kernels still see the whole CPU.

    .venv/bin/python -m benchmarks.engine.decode_step [--repeats 2] [--model PATH] [--dtype auto]
        [--cpu-isa avx2] [--smoke]
"""

from __future__ import annotations

import argparse
import random
import statistics

from benchmarks.support import add_model_flag, add_smoke_flag  # benchmarks/support.py

from chunkserve import LLM, SamplingParams

SCENARIOS = {"1 x ctx 64": [64], "8 x ctx 64": [64] * 8, "8 x ctx 1024": [1024] * 8,
             "8 x ctx 64 + 1 x ctx 2040": [64] * 8 + [2040]}
SMOKE_SCENARIOS = {"1 x ctx 16": [16], "2 x ctx 16 + 1 x ctx 48": [16, 16, 48]}
BACKENDS = ("torch", "cpp")
DECODE_TOKENS = 32


def decode_step_ms(llm: LLM, prompt_lens: list[int], seed: int, tokens: int = DECODE_TOKENS) -> float:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 49000) for _ in range(n)] for n in prompt_lens]
    before = len(llm.get_step_records())
    llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0), use_tqdm=False)
    steps = [r for r in llm.get_step_records()[before:]
             if r.forward_mode.name == "DECODE" and r.num_decode_tokens == len(prompt_lens)]
    return statistics.median(r.duration_s * 1000 for r in steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="auto", help="the engines' --dtype")
    parser.add_argument("--cpu-isa", choices=("avx512", "avx2", "portable"),
                        help="the C++ ops' instruction set (default: the best this CPU has)")
    add_model_flag(parser)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.cpu_isa is not None:
        from chunkserve.ops.cpp_ops import build_cpp_ops

        build_cpp_ops().set_cpu_isa(args.cpu_isa)
    scenarios, tokens = (SMOKE_SCENARIOS, 4) if args.smoke else (SCENARIOS, DECODE_TOKENS)
    repeats = 1 if args.smoke else args.repeats
    engines = {b: LLM(args.model, max_num_batched_tokens=2048, kv_cache_memory_gb=0.25 if args.smoke else 1,
                      op_backend=b, enable_prefix_caching=False, dtype=args.dtype) for b in BACKENDS}
    results: dict[tuple[str, str], list[float]] = {}
    for repeat in range(repeats):
        for name, lens in scenarios.items():
            for backend in BACKENDS:
                results.setdefault((name, backend), []).append(
                    decode_step_ms(engines[backend], lens, seed=repeat, tokens=tokens))
    isa = f", C++ ops on {args.cpu_isa}" if args.cpu_isa else ""
    print(f"dtype {engines['cpp'].engine.args.dtype}{isa}")
    print(f"{'scenario':<28}{'torch ms':>10}{'cpp ms':>10}{'speed-up':>10}")
    for name in scenarios:
        torch_ms, cpp_ms = (statistics.median(results[(name, b)]) for b in BACKENDS)
        print(f"{name:<28}{torch_ms:>10.1f}{cpp_ms:>10.1f}{torch_ms / cpp_ms:>9.2f}x")


if __name__ == "__main__":
    main()

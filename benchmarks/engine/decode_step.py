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

    .venv/bin/python -m benchmarks.engine.decode_step [--repeats 2] [--model PATH] [--smoke]
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
    add_model_flag(parser)
    add_smoke_flag(parser)
    args = parser.parse_args()
    scenarios, tokens = (SMOKE_SCENARIOS, 4) if args.smoke else (SCENARIOS, DECODE_TOKENS)
    repeats = 1 if args.smoke else args.repeats
    engines = {b: LLM(args.model, max_num_batched_tokens=2048, kv_cache_memory_gb=0.25 if args.smoke else 1,
                      op_backend=b, enable_prefix_caching=False) for b in BACKENDS}
    results: dict[tuple[str, str], list[float]] = {}
    for repeat in range(repeats):
        for name, lens in scenarios.items():
            for backend in BACKENDS:
                results.setdefault((name, backend), []).append(
                    decode_step_ms(engines[backend], lens, seed=repeat, tokens=tokens))
    print(f"{'scenario':<28}{'torch ms':>10}{'cpp ms':>10}{'speed-up':>10}")
    for name in scenarios:
        torch_ms, cpp_ms = (statistics.median(results[(name, b)]) for b in BACKENDS)
        print(f"{name:<28}{torch_ms:>10.1f}{cpp_ms:>10.1f}{torch_ms / cpp_ms:>9.2f}x")


if __name__ == "__main__":
    main()

"""Decode step time when one decoding request has a long context and the others short ones.

8 requests with 64-token prompts and one with a 2040-token prompt decode 32 tokens together;
prints the median duration of the steps that decode all 9. Before decodes were grouped by
context length, every decode was padded to the longest context, so this one long request
made every step about as slow as 9 long-context decodes.

    .venv/bin/python -m benchmarks.engine.mixed_context_decode [--model PATH] [--smoke]
"""

from __future__ import annotations

import argparse
import random
import statistics

from benchmarks.support import add_model_flag, add_smoke_flag  # benchmarks/support.py

from chunkserve import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add_model_flag(parser)
    add_smoke_flag(parser)
    args = parser.parse_args()
    short, long, tokens = (16, 200, 4) if args.smoke else (64, 2040, 32)
    llm = LLM(args.model, max_num_batched_tokens=2048, kv_cache_memory_gb=0.25 if args.smoke else 1)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49000) for _ in range(n)] for n in [short] * 8 + [long]]
    llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0), use_tqdm=False)
    steps = [r for r in llm.get_step_records() if r.forward_mode.name == "DECODE" and r.num_decode_tokens == 9]
    median_ms = statistics.median(r.duration_s * 1000 for r in steps)
    print(f"decode step, 8 short + 1 long context: median {median_ms:.0f} ms over {len(steps)} steps")


if __name__ == "__main__":
    main()

"""`chunkserve bench throughput`: offline throughput, as `vllm bench throughput` measures it.

The prompts go to the offline `LLM` all at once (every engine flag applies) and the command
reports requests, total tokens and output tokens per second of wall time, in vLLM's words, so a
number from a vLLM user's notes compares with ours. As vLLM's, every request generates exactly its
output length (ignore_eos) at temperature 1.0, and the prompts are random token ids
(--input-len, --output-len) or a ShareGPT file's conversations (--dataset-name sharegpt
--dataset-path FILE), counted by the model's own tokenizer.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from chunkserve.bench.datasets import SampledRequest, load_sharegpt, sample_sharegpt
from chunkserve.bench.serve import add_dataset_arguments, check_dataset_arguments, positive_int
from chunkserve.bench.workloads import random_prompt
from chunkserve.config.engine import EngineArgs
from chunkserve.entrypoints.args import add_cli_args, from_cli_args
from chunkserve.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags of `bench throughput` that apply here, then every engine flag (--seed, the
    engine's, also seeds the sampling of the prompts, as in vLLM)."""
    parser.add_argument("--input-len", type=positive_int, default=None,
                        help="random prompts: tokens per prompt (default 1024, vLLM's)")
    parser.add_argument("--output-len", type=positive_int, default=None,
                        help="output tokens per request (default 128 for random prompts; ShareGPT: the reply's length)")
    parser.add_argument("--num-prompts", type=positive_int, default=1000, help="number of prompts to process")
    parser.add_argument("--output-json", default=None, metavar="FILE", help="write the results as JSON here")
    add_dataset_arguments(parser)
    add_cli_args(EngineArgs, parser)


def main(args: argparse.Namespace) -> None:
    """Sample the prompts, run them through the engine at once, print vLLM's summary."""
    check_dataset_arguments(args)
    from chunkserve.entrypoints.llm import LLM  # after the flags are checked: the model takes seconds

    llm = LLM(**vars(from_cli_args(EngineArgs, args)))
    requests = sample_requests(args, llm.get_tokenizer())
    params = [SamplingParams(n=1, temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=r.output_len)
              for r in requests]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in requests], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    results = summarize(args, elapsed, len(requests), prompt_tokens, output_tokens)
    print(f"Throughput: {results['requests_per_second']:.2f} requests/s, {results['tokens_per_second']:.2f} "
          f"total tokens/s, {results['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    if args.output_json:
        with open(args.output_json, "w") as file:
            json.dump(results, file, indent=1)


def sample_requests(args: argparse.Namespace, tokenizer) -> list[SampledRequest]:
    """The benchmark's requests: a ShareGPT file's, or random token ids of the given lengths."""
    if args.dataset_name == "sharegpt":
        output_len = args.output_len if args.output_len is not None else args.sharegpt_output_len

        def tokenize(text: str) -> list[int]:
            return tokenizer(text).input_ids

        return sample_sharegpt(load_sharegpt(args.dataset_path, args.seed), tokenize, args.num_prompts, output_len,
                               args.seed)
    rng = np.random.default_rng(args.seed)
    vocab_size = len(tokenizer)
    input_len = args.input_len or 1024
    output_len = args.output_len or 128
    return [SampledRequest("", random_prompt(rng, input_len, vocab_size), output_len) for _ in range(args.num_prompts)]


def summarize(args: argparse.Namespace, elapsed: float, num_requests: int, prompt_tokens: int,
              output_tokens: int) -> dict:
    """vLLM's JSON keys (elapsed_time, num_requests, total_num_tokens, requests_per_second,
    tokens_per_second) plus the split of the tokens."""
    total = prompt_tokens + output_tokens
    return {"model_id": args.model, "elapsed_time": elapsed, "num_requests": num_requests,
            "total_num_tokens": total, "total_prompt_tokens": prompt_tokens, "total_output_tokens": output_tokens,
            "requests_per_second": num_requests / elapsed, "tokens_per_second": total / elapsed,
            "output_tokens_per_second": output_tokens / elapsed}

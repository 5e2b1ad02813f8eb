"""Data sets a vLLM user brings along: ShareGPT-format JSON files, sampled as vLLM's benchmarks
sample them, so `chunkserve bench serve` and `chunkserve bench throughput` send the same requests
as `vllm bench serve` / `vllm bench throughput` on the same file and seed.

vLLM's rules (vllm/benchmarks/datasets): keep conversations with at least two turns; shuffle them
with Python's `random` seeded by --seed; take the first turn as the prompt and the second as the
reference completion, whose token count is the output length unless --sharegpt-output-len fixes
it; skip pairs whose prompt or output is under 4 tokens, whose prompt is over 1024 or whose total
is over 2048; when fewer pairs pass than were asked for, draw the rest again from those that did.
Counting tokens takes a tokenizer: the caller passes one as a function (the engine's own offline,
the server's /tokenize when benchmarking a server), so this module needs neither.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

DATASET_NAMES = ("random", "sharegpt")
MIN_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048


class DatasetError(ValueError):
    """A data set or data-set flags that cannot be used, named in the message."""


@dataclass(frozen=True)
class SampledRequest:
    """One request drawn from a data set: the prompt as text and as token ids, and how many tokens
    to generate."""

    prompt: str
    prompt_token_ids: list[int]
    output_len: int


def is_valid_sequence(prompt_len: int, output_len: int, fixed_output_len: bool) -> bool:
    """vLLM's pruning of too short and too long pairs (the output's minimum is not checked when
    its length is fixed by the caller)."""
    too_short = prompt_len < MIN_LEN or (not fixed_output_len and output_len < MIN_LEN)
    return not (too_short or prompt_len > MAX_PROMPT_LEN or prompt_len + output_len > MAX_TOTAL_LEN)


def load_sharegpt(path: str, seed: int) -> list[tuple[str, str]]:
    """The (first turn, second turn) pairs of a ShareGPT file in vLLM's shuffled order; a clear
    DatasetError when the file is not a list of {"conversations": [{"value": ...}, ...]}."""
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
    except (OSError, json.JSONDecodeError) as error:
        raise DatasetError(f"--dataset-path {path}: {error}") from None
    if not isinstance(data, list):
        raise DatasetError(f"--dataset-path {path}: a ShareGPT file is a JSON list of conversations, "
                         f"got {type(data).__name__}")
    entries = [entry for entry in data
               if isinstance(entry, dict) and len(entry.get("conversations") or []) >= 2]
    random.Random(seed).shuffle(entries)  # the order of vLLM's random.seed(seed); random.shuffle(data)
    try:
        return [(entry["conversations"][0]["value"], entry["conversations"][1]["value"]) for entry in entries]
    except (KeyError, TypeError) as error:
        raise DatasetError(f"--dataset-path {path}: a conversation turn without a 'value' ({error})") from None


def sample_sharegpt(pairs: list[tuple[str, str]], tokenize: Callable[[str], list[int]], num_prompts: int,
                    output_len: int | None, seed: int) -> list[SampledRequest]:
    """`num_prompts` requests from `pairs`, in order, skipping the pairs vLLM skips; topped up by
    drawing again from those kept (vLLM's oversampling) when too few pass."""
    samples: list[SampledRequest] = []
    for prompt, completion in pairs:
        if len(samples) >= num_prompts:
            break
        prompt_ids = tokenize(prompt)
        wanted = len(tokenize(completion)) if output_len is None else output_len
        if is_valid_sequence(len(prompt_ids), wanted, fixed_output_len=output_len is not None):
            samples.append(SampledRequest(prompt, prompt_ids, wanted))
    if not samples:
        raise DatasetError("no conversation of the data set passes the length filters (prompt and output at least "
                         f"{MIN_LEN} tokens, prompt at most {MAX_PROMPT_LEN}, both at most {MAX_TOTAL_LEN})")
    if len(samples) < num_prompts:
        samples += random.Random(seed).choices(samples, k=num_prompts - len(samples))
    return samples

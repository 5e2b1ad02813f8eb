"""Synthetic workloads for `chunkserve bench serve`: what each request sends, and when.

Prompts are random token ids drawn uniformly from [100, vocab_size - 100) (clear of the special
tokens at both ends of a typical vocabulary), so the benchmark needs no tokenizer or data set.

- ``random``: ``num_prompts`` requests; input and output lengths uniform in
  ``[len * (1 - range_ratio), len * (1 + range_ratio)]`` (at least 1).
- ``sharegpt-like``: chat-like, heavy-tailed lengths. Input ~ lognormal(mu=ln(input_len),
  sigma=1.0) clipped to [4, 4 * input_len]; output ~ lognormal(mu=ln(output_len), sigma=0.8)
  clipped to [4, 4 * output_len]. The median of lognormal(mu, sigma) is exp(mu), so the medians
  are about input_len and output_len; the clip bounds keep every request inside the server's
  context limit. ``sharegpt_like_params`` gives these numbers for the result's config.
- ``interference``: ``streams`` decoding requests (kind "stream") sent at t=0, then
  ``long_prompts`` long prompts (kind "long") at ``long_start + i * long_every``: how much a
  long prefill stalls the token streams already running.
- ``prefix``: ``num_prompts`` requests (kind "prefix"), each a shared prefix of ``prefix_len``
  tokens (one of ``num_prefixes``, taken in turn: a system prompt, few-shot examples) and its
  own suffix of ``input_len`` tokens (uniform with ``range_ratio``).
- ``multi-turn``: ``num_prompts`` chats (kind "turn") of ``turns`` turns. The first turn is a
  system prompt of ``prefix_len`` tokens shared by every chat plus a user message of
  ``input_len`` tokens; each later turn resends the whole history plus an assistant reply of
  ``output_len`` tokens and a new user message, and is sent ``think_time`` seconds after the
  previous turn's response ended. The reply in the history is random tokens, not the
  server's actual output (the client sees text, not token ids), so a prefix cache can reuse
  the previous turn's prompt but not its generated tokens.

For ``random``, ``sharegpt-like`` and ``prefix`` the arrivals are a Poisson process at
``request_rate`` (all at t=0 when it is infinite); for ``multi-turn`` it is the chats' first
turns that arrive so.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import numpy as np

WORKLOADS = ("random", "sharegpt-like", "interference", "prefix", "multi-turn")
SHAREGPT_INPUT_SIGMA = 1.0
SHAREGPT_OUTPUT_SIGMA = 0.8
SHAREGPT_CLIP_LOW = 4
SHAREGPT_CLIP_FACTOR = 4
TOKEN_ID_MARGIN = 100


@dataclass
class RequestSpec:
    """One request to send: its prompt, how many tokens to ask for, and when: ``send_at``
    seconds after the start, or, when ``after`` is the index of another request, that many
    seconds after that request's response ended. ``prompt_text``, when set, is sent instead of
    the token ids (the text they decode to): for a router that reads text, as SMG does, which
    refuses a completion whose prompt is token ids."""

    prompt_token_ids: list[int]
    output_len: int
    send_at: float
    kind: str
    after: int | None = None
    prompt_text: str | None = None


def build_workload(args: argparse.Namespace, rng: np.random.Generator) -> list[RequestSpec]:
    """The requests of ``args.workload``; every ``after`` points to an earlier request."""
    if args.workload == "random":
        input_lens = uniform_lengths(rng, args.input_len, args.range_ratio, args.num_prompts)
        output_lens = uniform_lengths(rng, args.output_len, args.range_ratio, args.num_prompts)
    elif args.workload == "sharegpt-like":
        input_lens = lognormal_lengths(rng, args.input_len, SHAREGPT_INPUT_SIGMA, args.num_prompts)
        output_lens = lognormal_lengths(rng, args.output_len, SHAREGPT_OUTPUT_SIGMA, args.num_prompts)
    elif args.workload == "interference":
        return interference_workload(args, rng)
    elif args.workload == "prefix":
        return prefix_workload(args, rng)
    elif args.workload == "multi-turn":
        return multi_turn_workload(args, rng)
    else:
        raise ValueError(f"unknown workload {args.workload!r}; choose from {', '.join(WORKLOADS)}")
    send_ats = poisson_arrivals(rng, args.request_rate, args.num_prompts)
    return [RequestSpec(random_prompt(rng, n, args.vocab_size), m, t, "normal")
            for n, m, t in zip(input_lens, output_lens, send_ats)]


def interference_workload(args: argparse.Namespace, rng: np.random.Generator) -> list[RequestSpec]:
    """Streams at t=0, then long prompts every ``long_every`` seconds from ``long_start``."""
    streams = [RequestSpec(random_prompt(rng, args.stream_input_len, args.vocab_size), args.stream_output_len,
                           0.0, "stream") for _ in range(args.streams)]
    longs = [RequestSpec(random_prompt(rng, args.long_len, args.vocab_size), args.long_output_len,
                         args.long_start + i * args.long_every, "long") for i in range(args.long_prompts)]
    return streams + longs


def prefix_workload(args: argparse.Namespace, rng: np.random.Generator) -> list[RequestSpec]:
    """Requests sharing ``num_prefixes`` prefixes in turn, each with its own suffix."""
    prefixes = [random_prompt(rng, args.prefix_len, args.vocab_size) for _ in range(args.num_prefixes)]
    suffix_lens = uniform_lengths(rng, args.input_len, args.range_ratio, args.num_prompts)
    send_ats = poisson_arrivals(rng, args.request_rate, args.num_prompts)
    return [RequestSpec(prefixes[i % len(prefixes)] + random_prompt(rng, n, args.vocab_size), args.output_len, t,
                        "prefix") for i, (n, t) in enumerate(zip(suffix_lens, send_ats))]


def multi_turn_workload(args: argparse.Namespace, rng: np.random.Generator) -> list[RequestSpec]:
    """Chats whose every turn resends the history; turn k + 1 follows turn k's response."""
    system = random_prompt(rng, args.prefix_len, args.vocab_size)
    specs: list[RequestSpec] = []
    for start in poisson_arrivals(rng, args.request_rate, args.num_prompts):
        history = system + random_prompt(rng, args.input_len, args.vocab_size)
        specs.append(RequestSpec(history, args.output_len, start, "turn"))
        for _ in range(args.turns - 1):
            history = (history + random_prompt(rng, args.output_len, args.vocab_size)
                       + random_prompt(rng, args.input_len, args.vocab_size))
            specs.append(RequestSpec(history, args.output_len, args.think_time, "turn", after=len(specs) - 1))
    return specs


def sharegpt_like_params(input_len: int, output_len: int) -> dict:
    """The length distributions of the sharegpt-like workload, recorded in the result's config."""
    def lognormal(median: int, sigma: float) -> dict:
        low, high = clip_bounds(median)
        return {"distribution": "lognormal", "median": median, "mu": math.log(median), "sigma": sigma,
                "clip": [low, high]}

    return {"input": lognormal(input_len, SHAREGPT_INPUT_SIGMA),
            "output": lognormal(output_len, SHAREGPT_OUTPUT_SIGMA)}


def clip_bounds(median: int) -> tuple[int, int]:
    """[4, 4 * median], narrowed so that a median below 4 still fits."""
    return min(SHAREGPT_CLIP_LOW, median), SHAREGPT_CLIP_FACTOR * median


def uniform_lengths(rng: np.random.Generator, length: int, range_ratio: float, n: int) -> list[int]:
    """n integer lengths uniform in [length * (1 - r), length * (1 + r)], at least 1."""
    low = max(1, math.floor(length * (1 - range_ratio)))
    high = max(low, math.ceil(length * (1 + range_ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def lognormal_lengths(rng: np.random.Generator, median: int, sigma: float, n: int) -> list[int]:
    """n integer lengths ~ lognormal with the given median, clipped to ``clip_bounds(median)``."""
    low, high = clip_bounds(median)
    values = rng.lognormal(mean=math.log(median), sigma=sigma, size=n)
    return [int(x) for x in np.clip(np.rint(values), low, high)]


def poisson_arrivals(rng: np.random.Generator, rate: float, n: int) -> list[float]:
    """Send times of a Poisson process at ``rate`` requests/s (the first at 0); all 0 when infinite."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = rng.exponential(1.0 / rate, size=n)
    return [0.0] + [float(t) for t in np.cumsum(gaps[:-1])] if n else []


def random_prompt(rng: np.random.Generator, length: int, vocab_size: int) -> list[int]:
    """``length`` token ids uniform in [100, vocab_size - 100)."""
    return [int(t) for t in rng.integers(TOKEN_ID_MARGIN, vocab_size - TOKEN_ID_MARGIN, size=length)]

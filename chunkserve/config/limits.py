"""Bounds on what one request may ask for, checked by the frontend before any work is done
for it (tokenizing included), so one request cannot make the engine or the server spend
unbounded time or memory on it."""

from __future__ import annotations

from dataclasses import dataclass

CHARS_PER_TOKEN_BOUND = 32  # the default prompt-character limit per token of max_model_len


@dataclass(frozen=True)
class RequestLimits:
    max_prompt_chars: int
    max_stop_sequences: int
    max_stop_sequence_chars: int
    max_stop_token_ids: int
    max_logit_bias: int
    max_logprobs: int = 20  # logprobs and prompt_logprobs (--max-logprobs)

"""Bounds on what one request may ask for, checked by the frontend before any work is done
for it (tokenizing included), so one request cannot make the engine or the server spend
unbounded time or memory on it."""

from __future__ import annotations

from dataclasses import dataclass

from chunkserve.config.fields import REQUIRED, arg
from chunkserve.errors import InvalidRequestError
from chunkserve.sampling_params import MAX_LOGPROBS

CHARS_PER_TOKEN_BOUND = 32  # the default prompt-character limit per token of max_model_len


@dataclass(frozen=True)
class RequestLimits:
    max_prompt_chars: int = arg(
        REQUIRED, f"longer prompts are refused before they are tokenized (default: {CHARS_PER_TOKEN_BOUND} x "
        "max_model_len)"
    )
    max_stop_sequences: int = arg(64, "most stop strings one request may give")
    max_stop_sequence_chars: int = arg(1024, "longest stop string, in characters")
    max_stop_token_ids: int = arg(1024, "most stop token ids one request may give")
    max_logit_bias: int = arg(1024, "most logit_bias entries one request may give")
    max_logprobs: int = arg(20, "most logprobs (and prompt_logprobs) one request may ask for")

    def __post_init__(self) -> None:
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"max_logprobs must be in [0, {MAX_LOGPROBS}], got {self.max_logprobs}")
        for name in ("max_prompt_chars", "max_stop_sequences", "max_stop_sequence_chars", "max_stop_token_ids",
                     "max_logit_bias"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be positive, got {getattr(self, name)}")

    @staticmethod
    def default_prompt_chars(max_model_len: int) -> int:
        return CHARS_PER_TOKEN_BOUND * max_model_len

"""Per-request sampling and stopping parameters (the vLLM / OpenAI field names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from chunkserve.errors import InvalidRequestError

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    `temperature == 0` means greedy. `max_tokens=None` means "up to the model's length
    limit". Stop strings are matched on the detokenized text and are not included in it.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob and the top k

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def fail(message: str) -> None:
            raise InvalidRequestError(message, param=message.split(" ", 1)[0])  # messages start with the field

        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            fail(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            fail(f"top_k must be 0 or -1 (disabled) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            fail(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            fail(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.min_tokens < 0:
            fail(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids must be non-negative integers")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            fail(f"seed must fit in 64 bits, got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            fail(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )

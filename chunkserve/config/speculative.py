"""Speculative decoding's configuration, in vLLM's shape (`--speculative-config` JSON).

`ngram` proposes from the request's own tokens (prompt lookup, in the engine core); `draft_model`
runs a second, usually smaller, model of the same tokenizer in the worker. Either way the target
model verifies every draft in the next step, so the output is the target's own.

`policy` decides who gets drafts: `always` gives them to every decode that has some, `auto`
(the default) only while the request's running acceptance rate makes them pay against the
extra step time the step-time model predicts for them (under load, drafting turns itself off).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chunkserve.config.fields import parse_json_object
from chunkserve.errors import InvalidRequestError

SPECULATIVE_METHODS = ("ngram", "draft_model")
DRAFT_POLICIES = ("auto", "always")
MAX_SPECULATIVE_TOKENS = 32
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default for both bounds when neither is given


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    model: str | None = None  # draft_model: the draft's folder or .gguf file
    policy: str = "auto"

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From `--speculative-config`'s JSON text, or the same as a dict (the Python API)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = parse_json_object("speculative_config", value, {
            "method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model", "policy"})
        method = value.get("method")
        if method not in SPECULATIVE_METHODS:
            raise InvalidRequestError(f"speculative_config method must be one of {SPECULATIVE_METHODS}, got {method!r}")
        k = value.get("num_speculative_tokens")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise InvalidRequestError("speculative_config needs num_speculative_tokens, an integer in "
                                      f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        lookup_min, lookup_max = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if lookup_min is None and lookup_max is None:
            lookup_min = lookup_max = DEFAULT_PROMPT_LOOKUP
        lookup_min = lookup_max if lookup_min is None else lookup_min
        lookup_max = lookup_min if lookup_max is None else lookup_max
        for name, n in (("prompt_lookup_min", lookup_min), ("prompt_lookup_max", lookup_max)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise InvalidRequestError(f"speculative_config {name} must be a positive integer, got {n!r}")
        if lookup_min > lookup_max:
            raise InvalidRequestError(f"speculative_config prompt_lookup_min ({lookup_min}) must not exceed "
                                      f"prompt_lookup_max ({lookup_max})")
        model = value.get("model")
        if method == "draft_model" and not (isinstance(model, str) and model.strip()):
            raise InvalidRequestError('speculative_config method "draft_model" needs "model": the draft\'s folder or '
                                      ".gguf file (a model of the same tokenizer)")
        if method == "ngram" and model is not None:
            raise InvalidRequestError('speculative_config method "ngram" takes no "model" (it drafts from the '
                                      "request's own tokens)")
        policy = value.get("policy", "auto")
        if policy not in DRAFT_POLICIES:
            raise InvalidRequestError(f"speculative_config policy must be one of {DRAFT_POLICIES}, got {policy!r}")
        return cls(method, k, lookup_min, lookup_max, model, policy)

    @property
    def drafts_in_worker(self) -> bool:
        """The worker proposes (a draft model), rather than the engine core (n-gram lookup)."""
        return self.method == "draft_model"

"""Structured outputs' server-wide configuration, in vLLM's shape (`--structured-outputs-config`
JSON, vLLM's StructuredOutputsConfig keys).

chunkserve has one grammar backend, llguidance, chosen by measurement (benchmarks/engine/grammar_backends.py,
docs/STRUCTURED_OUTPUTS.md): `auto`, `guidance` (vLLM's name for it) and `llguidance` all select it.
vLLM's other backends are refused by name rather than silently replaced, since a user naming one
expects its behaviour. `disable_any_whitespace` and `disable_additional_properties` are defaults
for every request: a request turns either on for itself, not off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chunkserve.config.fields import parse_json_object
from chunkserve.errors import InvalidRequestError

BACKENDS = ("auto", "guidance", "llguidance")  # all mean llguidance
OTHER_BACKENDS = ("xgrammar", "outlines", "lm-format-enforcer")  # vLLM's (and SGLang's), not built here
# vLLM's reasoning keys: accepted at their defaults (which ask for nothing), refused otherwise
_REASONING_KEYS = {"reasoning_parser": "", "reasoning_parser_plugin": "", "enable_in_reasoning": False}


@dataclass(frozen=True)
class StructuredOutputsConfig:
    backend: str = "auto"
    disable_any_whitespace: bool = False  # JSON without whitespace between tokens (compact)
    disable_additional_properties: bool = False  # a schema's objects take only the properties it names

    @classmethod
    def parse(cls, value: str | dict[str, Any] | StructuredOutputsConfig | None) -> StructuredOutputsConfig:
        """From `--structured-outputs-config`'s JSON text, or the same as a dict (the Python API);
        None is the default configuration. Raises InvalidRequestError naming the bad key or value."""
        if value is None:
            return cls()
        if isinstance(value, StructuredOutputsConfig):
            return value
        value = parse_json_object("structured_outputs_config", value, {
            "backend", "disable_any_whitespace", "disable_additional_properties", "disable_fallback",
            *_REASONING_KEYS})
        for key, default in _REASONING_KEYS.items():
            if value.get(key, default) != default:
                raise InvalidRequestError(f"structured_outputs_config {key} is not supported: there are no reasoning "
                                          "parsers here")
        backend = value.get("backend", "auto")
        if backend in OTHER_BACKENDS:
            raise InvalidRequestError(
                f"structured_outputs_config backend {backend!r} is not supported: chunkserve measured xgrammar, "
                "outlines-core and llguidance on CPU and constrains decoding with llguidance "
                f"(docs/STRUCTURED_OUTPUTS.md); use one of {BACKENDS}, which all select it")
        if backend not in BACKENDS:
            raise InvalidRequestError(f"structured_outputs_config backend must be one of {BACKENDS}, got {backend!r}")
        # disable_fallback (vLLM's): there is one backend, so nothing to fall back to either way
        for key in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
            if not isinstance(value.get(key, False), bool):
                raise InvalidRequestError(f"structured_outputs_config {key} must be true or false, "
                                          f"got {value[key]!r}")
        return cls(backend, value.get("disable_any_whitespace", False),
                   value.get("disable_additional_properties", False))

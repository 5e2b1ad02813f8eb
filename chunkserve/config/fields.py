"""The building blocks of the configuration classes: `arg` (a dataclass field that is also a
command-line flag, its default and help text written once, on the leaf config that owns it),
`flag_of` (EngineArgs' flag for a leaf's field, referring to it rather than copying it), and the
parsers of flag values: vLLM's human-readable sizes and JSON-object flags."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from dataclasses import MISSING, field
from typing import Any

from chunkserve.errors import InvalidRequestError

REQUIRED: Any = MISSING  # `arg`'s default for a leaf field the engine resolves (no flag default)


def arg(default: Any, help: str, **extra: Any) -> Any:
    """A dataclass field that is also a command-line flag, with its help text. `extra`: choices,
    aliases (other spellings, e.g. SGLang's), negative_aliases (switches that turn a bool off),
    type (parses the flag's value), nargs."""
    return field(default=default, metadata={"help": help, **extra})


def flag_of(leaf: type, name: str, default: Any = MISSING) -> Any:
    """EngineArgs' flag for the field `name` of the leaf config `leaf`: the leaf's default and
    metadata (help, choices, aliases...). `default`: the flag's own default, where the engine
    resolves the leaf's field (None on the flag: resolved from the model)."""
    leaf_field = {f.name: f for f in dataclasses.fields(leaf)}[name]
    value = leaf_field.default if default is MISSING else default
    if value is MISSING:
        raise TypeError(f"{leaf.__name__}.{name} has no default: give the flag's own (default=...)")
    return field(default=value, metadata=leaf_field.metadata)


def human_readable_int(value: str) -> int:
    """vLLM's sizes on the command line: 32k = 32,000, 32K = 32,768 (2^10), 1.5m = 1,500,000;
    a binary suffix takes whole numbers only."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value.strip())
    if not match:
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not an integer (32000, 32k, 32K)") from None
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if "." in number:
        raise argparse.ArgumentTypeError(f"{value!r}: a binary suffix ({suffix}) takes a whole number; did you mean "
                                         f"{number}{suffix.lower()}?")
    return int(number) * 1024 ** ("KMGT".index(suffix) + 1)


def parse_json_object(name: str, value: str | dict[str, Any], known: set[str]) -> dict[str, Any]:
    """A JSON-object flag (`--speculative-config`, `--structured-outputs-config`), given as JSON
    text or as a dict (the Python API), with its keys checked against `known`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise InvalidRequestError(f"{name} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{name} must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidRequestError(f"{name} has unknown key(s) {unknown}; known: {sorted(known)}")
    return value

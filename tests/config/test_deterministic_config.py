"""The deterministic mode's switch: its flag and SGLang's spelling, vLLM's environment variable,
and the settings it cannot be deterministic with, refused naming the flags."""

from __future__ import annotations

import argparse

import pytest

from chunkserve.config.engine import BATCH_INVARIANT_ENV, EngineArgs
from chunkserve.entrypoints.args import add_cli_args, from_cli_args
from chunkserve.errors import InvalidRequestError


def parsed(*flags: str) -> EngineArgs:
    parser = argparse.ArgumentParser()
    add_cli_args(EngineArgs, parser)
    return from_cli_args(EngineArgs, parser.parse_args(list(flags)))


@pytest.fixture(autouse=True)
def no_batch_invariant_env(monkeypatch):
    monkeypatch.delenv(BATCH_INVARIANT_ENV, raising=False)


@pytest.mark.parametrize("flags, expected", [
    ((), False),
    (("--deterministic",), True),
    (("--enable-deterministic-inference",), True),  # SGLang's
    (("--deterministic", "--no-deterministic"), False),
])
def test_the_flag_and_sglangs_alias_turn_the_mode_on(flags, expected):
    assert parsed(*flags).deterministic is expected


@pytest.mark.parametrize("value, expected", [("1", True), ("0", False), ("", False)])
def test_vllms_environment_variable_is_a_synonym(monkeypatch, value, expected):
    monkeypatch.setenv(BATCH_INVARIANT_ENV, value)
    assert EngineArgs().deterministic is expected
    assert parsed().deterministic is expected


def test_a_malformed_environment_variable_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "yes please")
    with pytest.raises(InvalidRequestError, match=f"{BATCH_INVARIANT_ENV} must be 0 or 1"):
        EngineArgs()


@pytest.mark.parametrize("fields, flag", [
    (dict(op_backend="torch"), "--op-backend torch"),
    (dict(int8_activations=True), "--int8-activations"),
])
def test_settings_that_cannot_be_deterministic_are_refused(fields, flag):
    with pytest.raises(InvalidRequestError, match=f"--deterministic.*{flag}"):
        EngineArgs(deterministic=True, **fields)
    EngineArgs(**fields)  # fine without the mode


def test_the_environment_variable_is_checked_like_the_flag(monkeypatch):
    monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")
    with pytest.raises(InvalidRequestError, match="--op-backend torch"):
        EngineArgs(op_backend="torch")

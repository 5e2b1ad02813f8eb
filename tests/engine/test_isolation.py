"""One request's bad data never fails the others: a step that raises is void, the requests at
fault are failed alone (named by the runner, or found by bisection), and every other request
finishes with exactly the tokens it gets without the poisoned one beside it."""

from __future__ import annotations

import math

import pytest

from chunkserve.config import EngineArgs
from chunkserve.engine.core import EngineCore
from chunkserve.engine.messages import EngineCoreRequest
from chunkserve.sampling_params import SamplingParams
from tests.engine.support import PROMPTS, healthy_requests, run


@pytest.fixture(scope="module")
def core(tiny_gguf):
    """default_llm's budget on the tiny model: fault isolation is behaviour, not weights."""
    return EngineCore(EngineArgs(dtype="float32", model=tiny_gguf, max_model_len=4096, max_num_batched_tokens=64,
                                 kv_cache_memory_gb=0.25, max_num_seqs=32))


def poisoned(kind: str) -> EngineCoreRequest:
    """A request that reached the core without the frontend's checks."""
    params = SamplingParams(max_tokens=10, temperature=0.7)
    prompt = [1200, 1300, 1400]
    if kind == "token_id":
        prompt = [1200, 10**7, 1400]
    elif kind == "nan_temperature":
        params.temperature = math.nan
    elif kind == "tiny_repetition_penalty":
        params.repetition_penalty = 1e-45
    return EngineCoreRequest("poisoned", prompt, params, None, arrival_time=3.5)  # in the middle of the batch


@pytest.mark.parametrize("kind, reason", [
    ("token_id", "outside the vocabulary"),
    ("nan_temperature", "not a probability distribution"),
    ("tiny_repetition_penalty", "not a probability distribution"),
])
def test_a_poisoned_request_fails_alone(core, kind, reason):
    """The worker names the request (no bisection), and its id can be used again at once."""
    alone, _ = run(core, healthy_requests())
    tokens, errors = run(core, healthy_requests() + [poisoned(kind)])
    assert set(errors) == {"poisoned"} and reason in errors["poisoned"]
    assert tokens.pop("poisoned") == []
    assert tokens == alone


def test_a_failure_nobody_is_named_for_is_bisected_to_its_request(core, monkeypatch):
    """The executor raises whenever one request is in the step, without naming it: the core
    holds halves of the batch out until a step of that request alone fails."""
    alone, _ = run(core, healthy_requests())
    execute = core.executor.execute_model
    failed_steps = []

    def fragile(scheduler_output):
        if any(s.request_id == "healthy-5" for s in scheduler_output.scheduled):
            failed_steps.append(len(scheduler_output.scheduled))
            raise RuntimeError("a kernel failed")
        return execute(scheduler_output)

    monkeypatch.setattr(core.executor, "execute_model", fragile)
    tokens, errors = run(core, healthy_requests())
    assert set(errors) == {"healthy-5"} and "a kernel failed" in errors["healthy-5"]
    del tokens["healthy-5"], alone["healthy-5"]
    assert tokens == alone
    assert failed_steps[-1] == 1 and len(failed_steps) <= 2 * math.ceil(math.log2(len(PROMPTS))) + 2


def test_a_failure_every_step_has_fails_each_request_but_never_hangs(core, monkeypatch):
    def broken(_):
        raise RuntimeError("the device is gone")

    monkeypatch.setattr(core.executor, "execute_model", broken)
    tokens, errors = run(core, healthy_requests())
    assert set(errors) == set(tokens) and all(t == [] for t in tokens.values())

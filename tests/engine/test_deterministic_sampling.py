"""LLM(deterministic=True) reaches the sampler: an unseeded request's tokens follow from the
engine's --seed and its id, not from what the engine sampled before (the default mode's shared
generator: the contrast); the samples of n > 1 differ; every step record says the mode is on."""

from __future__ import annotations

import pytest

from chunkserve import LLM, SamplingParams

SAMPLED = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)


def tiny_llm(tiny_gguf: str, **flags) -> LLM:
    return LLM(tiny_gguf, dtype="float32", max_model_len=256, kv_cache_memory_gb=0.02, seed=3, **flags)


def run_alone(llm: LLM, request_id: str, prompt: str) -> list[int]:
    """The request's tokens, run with nothing beside it."""
    engine = llm.engine
    engine.add_request(request_id, prompt, SAMPLED)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                tokens = output.outputs[0].token_ids
    return list(tokens)


def tokens_before_and_after_another_request(llm: LLM) -> tuple[list[int], list[int]]:
    """One request's tokens, and the same request's once the engine has sampled another one."""
    before = run_alone(llm, "r1", "Once upon a time")
    run_alone(llm, "warm-up", "A different prompt")
    return before, run_alone(llm, "r1", "Once upon a time")


@pytest.fixture(scope="module")
def deterministic_llm(tiny_gguf):
    return tiny_llm(tiny_gguf, deterministic=True)


def test_an_unseeded_request_follows_its_id_not_the_engines_history(deterministic_llm, tiny_gguf):
    before, after = tokens_before_and_after_another_request(deterministic_llm)
    assert before == after
    default_before, default_after = tokens_before_and_after_another_request(tiny_llm(tiny_gguf))
    assert default_before != default_after  # the contrast: one generator shared by every unseeded request


def test_the_samples_of_n_differ_and_each_seeded_one_repeats(deterministic_llm):
    unseeded = deterministic_llm.generate("Once upon a time", SamplingParams(n=2, max_tokens=4, ignore_eos=True))
    first, second = (o.token_ids for o in unseeded[0].outputs)
    assert first != second
    seeded = SamplingParams(n=2, max_tokens=4, ignore_eos=True, seed=42)
    runs = [[o.token_ids for o in deterministic_llm.generate("Once upon a time", seeded)[0].outputs]
            for _ in range(2)]
    assert runs[0] == runs[1] and runs[0][0] != runs[0][1]


def test_every_step_record_says_the_mode_is_on(deterministic_llm):
    deterministic_llm.generate("Hello", SamplingParams(max_tokens=2))
    records = deterministic_llm.get_step_records()
    assert records and all(record.deterministic for record in records)

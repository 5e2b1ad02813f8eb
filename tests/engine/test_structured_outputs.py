"""Structured outputs end to end. On the default SmolLM2 model (they need a model that closes
its JSON by itself): sampled JSON-schema outputs validate, json_object outputs are objects. On
the tiny model (behaviour): choice / regex outputs are what they say; an invalid schema is
refused; a constrained greedy output is the same under every chunking and budget, with n-gram
speculation too, and an unconstrained request that shares its steps is token-identical to
decoding alone; a grammar that compiles for a long time holds up nobody's steps; a request
failed or aborted while its grammar compiles leaves the engine clean."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from chunkserve import LLM, SamplingParams
from chunkserve.errors import InvalidRequestError
from chunkserve.sampling_params import StructuredOutputsParams
from tests.engine.support import assert_pool_free
from tests.engine.tiny_llm_support import TINY, build_llm

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Tokyo", "Lima"]},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5,
         "policy": "always"}


def prompt(llm: LLM, text: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text}])


def constrained(max_tokens: int = 96, temperature: float = 0.0, **constraint) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=temperature,
                          structured_outputs=StructuredOutputsParams(**constraint))


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_num_batched_tokens=512, kv_cache_memory_gb=0.25, max_num_seqs=32)


@pytest.fixture(scope="module")
def tiny(tiny_gguf):
    return build_llm(TINY, tiny_gguf, max_num_batched_tokens=512, max_num_seqs=32)


def test_sampled_json_schema_outputs_validate(llm):
    person = prompt(llm, "Describe a fictional person as a JSON object with name, age, city and languages.")
    params = [constrained(160, 0.8, json=PERSON, disable_any_whitespace=True) for _ in range(20)]
    params = [SamplingParams(**{**vars(p), "seed": seed}) for seed, p in enumerate(params)]
    outputs = llm.generate([person] * 20, params, use_tqdm=False)
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), PERSON)
    assert len({o.outputs[0].text for o in outputs}) > 1  # seeds differ: so do the people
    assert_pool_free(llm)


def test_choice_and_regex_outputs(tiny):
    """A choice or a fixed-length pattern ends by itself, whatever the weights."""
    choices = ["Paris", "London", "Berlin", "Madrid"]
    outputs = tiny.generate(
        [prompt(tiny, "What is the capital of France?"), prompt(tiny, "Give me a US phone number.")],
        [constrained(choice=choices), constrained(regex=r"\(\d{3}\) \d{3}-\d{4}")], use_tqdm=False)
    texts = [o.outputs[0].text for o in outputs]
    assert texts[0] in choices
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", texts[1])
    assert [o.outputs[0].finish_reason for o in outputs] == ["stop"] * 2


def test_json_object_outputs(llm):
    outputs = llm.generate(
        [prompt(llm, 'Answer with a JSON object like {"greeting": "..."}.'), prompt(llm, "Say hello in JSON.")],
        [constrained(json_object=True, max_tokens=256),
         constrained(temperature=0.7, json_object=True, disable_any_whitespace=True, max_tokens=256)],
        use_tqdm=False)
    for text in [o.outputs[0].text for o in outputs]:
        assert isinstance(json.loads(text), dict), text
    assert [o.outputs[0].finish_reason for o in outputs] == ["stop"] * 2


def test_an_invalid_schema_is_refused_by_name(tiny):
    with pytest.raises(InvalidRequestError, match="nonsense"):
        tiny.generate("hi", constrained(json={"type": "nonsense"}), use_tqdm=False)


def test_greedy_constrained_output_is_the_same_under_every_chunking_and_beside_others(tiny_gguf, tiny):
    """Budgets 16 and 512, chunked prefill on and off, n-gram speculation: the same constrained
    tokens; the unconstrained request decoded in the same steps is token-identical to decoding
    it alone (a grammar masks its own rows only). On the tiny model the schema's bounds (and no
    free whitespace) close the object within max_tokens."""
    reference = tiny
    schema_prompt = prompt(reference, "Describe a fictional person as a JSON object. " * 6)  # a few chunks at 16
    free_prompt = prompt(reference, "Write a short story about a lighthouse keeper.")
    free = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True)  # outlasts the constrained answer
    alone = reference.generate([free_prompt], free, use_tqdm=False)[0].outputs[0].token_ids
    expected = None
    for args in ({"max_num_batched_tokens": 512}, {"max_num_batched_tokens": 16},
                 {"max_num_batched_tokens": 2048, "max_model_len": 2048, "enable_chunked_prefill": False},
                 {"max_num_batched_tokens": 64, "speculative_config": NGRAM}):
        llm = reference if args == {"max_num_batched_tokens": 512} else build_llm(TINY, tiny_gguf, **args)
        # the grammar compiled (and the tokenizer loaded) beforehand: the two requests start together
        llm.generate(schema_prompt, constrained(max_tokens=1, json=PERSON, disable_any_whitespace=True),
                     use_tqdm=False)
        outputs = llm.generate([schema_prompt, free_prompt],
                               [constrained(json=PERSON, disable_any_whitespace=True), free], use_tqdm=False)
        got = outputs[0].outputs[0].token_ids
        jsonschema.validate(json.loads(outputs[0].outputs[0].text), PERSON)
        expected = expected or got
        assert got == expected, args
        assert outputs[1].outputs[0].token_ids == alone, args
        if args["max_num_batched_tokens"] > 16:  # (at 16, a prompt chunk, whole blocks of 16, waits out any decode)
            assert any(r.num_requests == 2 for r in llm.get_step_records()), f"{args}: never in one step"


def test_a_long_compile_holds_up_no_other_requests_steps(tiny):
    """A schema of 3,000 properties compiles for a while on its own thread; meanwhile the
    other request's steps go on: steps that produced its tokens ended while the compile was
    still running (seen by its future not done), so the step loop never waited for it."""
    llm = tiny
    huge = {"type": "object", "properties": {f"field_{i}": {"type": "string", "pattern": "[a-z]{2,9}@[a-z]+\\.org"}
                                             for i in range(3000)},
            "required": [f"field_{i}" for i in range(3)]}
    engine = llm.engine
    before = len(llm.get_step_records())
    engine.add_request("free", prompt(llm, "Count from one to fifty."),
                       SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    for _ in range(3):  # the free request is decoding when the constrained one arrives
        engine.step()
    engine.add_request("huge", prompt(llm, "Fill in the form."), constrained(max_tokens=8, json=huge))
    compiling = engine.engine_core.structured._compiling["huge"]  # the compile's future
    finished = set()
    steps_before_the_compile_ended = 0  # steps that gave the free request a token, the compile still running
    free_tokens = 0
    while len(finished) < 2:
        outputs = engine.step()
        finished |= {o.request_id for o in outputs if o.finished}
        now = max([len(o.outputs[0].token_ids) for o in outputs if o.request_id == "free"], default=free_tokens)
        steps_before_the_compile_ended += now > free_tokens and not compiling.done()
        free_tokens = now
    records = llm.get_step_records()[before:]
    compiles = [c for r in records for c in r.grammar_compile_s]
    assert compiles and max(compiles) > 0.05, compiles  # long enough to matter
    compile_s = max(compiles)
    scheduled_huge = next(i for i, r in enumerate(records) if r.grammar_compile_s)  # the record after the compile
    steps_meanwhile = records[3:scheduled_huge + 1]
    assert len(steps_meanwhile) >= 2, "no step ran while the grammar compiled"
    assert steps_before_the_compile_ended >= 2, f"the steps waited for the {compile_s:.2f} s compile"
    assert_pool_free(llm)


def test_requests_aborted_while_their_grammar_compiles_leave_the_engine_clean(tiny):
    llm = tiny
    engine = llm.engine
    big = {"type": "object", "properties": {f"f{i}": {"type": "integer"} for i in range(500)}}
    engine.add_request("compiling", prompt(llm, "hi"), constrained(json=big))
    engine.add_request("other", prompt(llm, "hi"), SamplingParams(max_tokens=4, temperature=0.0))
    engine.abort_request(["compiling"])
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.engine_core.structured.has("compiling")
    assert_pool_free(llm)

"""vLLM's request fields, honoured end to end (input processor, scheduler, runner, sampler,
output processor): allowed_token_ids, bad_words, logit_bias, include_stop_str_in_output,
truncate_prompt_tokens, prompt_logprobs (equal to transformers' on the same weights, with
chunked prefill and with the prefix cache holding the prompt); a bad value is refused naming its
field, and one request's bad value never fails the others."""

from __future__ import annotations

import dataclasses
import itertools
import random
import re

import pytest
import torch

from chunkserve.config.engine import EngineArgs
from chunkserve.core.messages import EngineCoreOutput, TokenLogprobs
from chunkserve.engine.core import EngineCore
from chunkserve.engine.detokenizer import IncrementalDetokenizer
from chunkserve.engine.input_processor import tokenize_bad_words
from chunkserve.engine.llm_engine import LLMEngine
from chunkserve.engine.messages import EngineCoreRequest
from chunkserve.engine.output_processor import OutputProcessor
from chunkserve.engine.outputs import RequestOutput
from chunkserve.errors import InvalidRequestError
from chunkserve.sampling_params import RequestOutputKind, SamplingParams
from tests.engine.support import healthy_requests, run


def tiny_args(tiny_gguf: str) -> dict:
    """default_llm's budget on the tiny model: the fields' semantics are behaviour, not weights."""
    return dict(model=tiny_gguf, max_model_len=4096, max_num_batched_tokens=64, kv_cache_memory_gb=0.25,
                max_num_seqs=32)


PROMPT = "The history of the printing press begins in"
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
_ids = itertools.count()


@pytest.fixture(scope="module")
def llm(tiny_gguf):
    return LLMEngine(EngineArgs(dtype="float32", **tiny_args(tiny_gguf)))


def generate(llm: LLMEngine, prompts: list, params: SamplingParams) -> list[RequestOutput]:
    """Each prompt's last output (all running together)."""
    ids = [f"r{next(_ids)}" for _ in prompts]
    for request_id, prompt in zip(ids, prompts):
        llm.add_request(request_id, prompt, params)
    last: dict[str, RequestOutput] = {}
    while llm.has_unfinished_requests():
        for output in llm.step():
            last[output.request_id] = output
    assert all(last[i].finished for i in ids)
    return [last[i] for i in ids]


@pytest.fixture(scope="module")
def greedy(llm) -> RequestOutput:
    """PROMPT's greedy output, with no field set."""
    return generate(llm, [PROMPT], GREEDY)[0]


def greedy_tokens(llm: LLMEngine, prompt, **changes) -> list[int]:
    return generate(llm, [prompt], dataclasses.replace(GREEDY, **changes))[0].outputs[0].token_ids


def contains(tokens: list[int], run: list[int]) -> bool:
    return any(tokens[i : i + len(run)] == run for i in range(len(tokens) - len(run) + 1))


# ----- allowed_token_ids, bad_words, logit_bias --------------------------------------------------

def test_allowed_token_ids_restrict_every_generated_token(llm):
    allowed = sorted(set(llm.tokenizer.encode(" the a cat dog sat ran on in mat park and", add_special_tokens=False)))
    sampled = SamplingParams(max_tokens=16, temperature=1.0, seed=0, ignore_eos=True, allowed_token_ids=allowed)
    for params in (sampled, dataclasses.replace(sampled, temperature=0.0)):
        (output,) = generate(llm, [PROMPT], params)
        assert len(output.outputs[0].token_ids) == 16 and set(output.outputs[0].token_ids) <= set(allowed)


def test_a_one_token_bad_word_is_never_generated_and_changes_the_greedy_output(llm, greedy):
    """A generated whole word whose forms with and without a leading space are one token each
    (vLLM's rule bans both): banned, greedy picks another token there, and neither form appears."""
    reference = greedy.outputs[0].token_ids
    for index, token in enumerate(reference):
        word = llm.tokenizer.decode([token]).strip()
        runs = tokenize_bad_words(llm.tokenizer, [word]) if re.fullmatch(r"[A-Za-z]{3,}", word) else []
        if [token] in runs and all(len(run) == 1 and run[0] not in reference[:index] for run in runs):
            break
    else:
        raise AssertionError(f"no one-token word in {llm.tokenizer.decode(reference)!r}")
    banned = greedy_tokens(llm, PROMPT, bad_words=[word])
    assert banned[:index] == reference[:index] and banned[index] != reference[index]
    assert not any(contains(banned, run) for run in runs)


def test_a_two_token_bad_word_bans_its_end_only_after_its_start(llm, greedy):
    """Two generated tokens as one bad word: the first is still generated, the second never after it."""
    reference = greedy.outputs[0].token_ids
    for index in range(len(reference) - 1):
        pair = llm.tokenizer.decode(reference[index : index + 2])
        runs = tokenize_bad_words(llm.tokenizer, [pair])
        if reference[index : index + 2] in runs and not any(contains(reference[: index + 1], run) for run in runs):
            break
    else:
        raise AssertionError(f"no token pair of {llm.tokenizer.decode(reference)!r} tokenizes back to itself")
    banned = greedy_tokens(llm, PROMPT, bad_words=[pair])
    assert banned[: index + 1] == reference[: index + 1] and banned[index + 1] != reference[index + 1]
    assert not any(contains(banned, run) for run in runs)


def test_a_large_negative_logit_bias_on_the_greedy_token_changes_it(llm, greedy):
    reference = greedy.outputs[0].token_ids
    biased = greedy_tokens(llm, PROMPT, logit_bias={reference[0]: -100.0})
    assert biased[0] != reference[0]


# ----- stop strings, prompt truncation -----------------------------------------------------------

@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_include_stop_str_in_output_keeps_the_stop_string(llm, greedy, kind):
    text = greedy.outputs[0].text
    stop = text.split()[3]
    end = text.index(stop) + len(stop)
    llm.add_request(f"r{next(_ids)}", PROMPT, dataclasses.replace(GREEDY, stop=[stop], include_stop_str_in_output=True,
                                                                   output_kind=kind))
    outputs = []
    while llm.has_unfinished_requests():
        outputs += llm.step()
    completion = outputs[-1].outputs[0]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert "".join(o.outputs[0].text_delta for o in outputs) == text[:end]  # what a stream sends
    if kind == RequestOutputKind.CUMULATIVE:
        assert completion.text == text[:end]


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_tokens_text_is_left_out_unless_stop_strings_are_kept(llm, greedy, include):
    """vLLM's rule for the stop token that finishes a request (EOS or one of stop_token_ids)."""
    reference = greedy.outputs[0].token_ids
    index = next(i for i in range(1, len(reference)) if reference[i] not in reference[:i])
    (output,) = generate(llm, [PROMPT], dataclasses.replace(GREEDY, stop_token_ids=[reference[index]],
                                                             include_stop_str_in_output=include))
    completion = output.outputs[0]
    assert completion.token_ids == reference[: index + 1] and completion.stop_reason == reference[index]
    assert completion.text == llm.tokenizer.decode(reference[: index + 1 if include else index])


def test_a_kept_stop_string_is_found_across_tokens_and_nothing_is_held_back(default_tokenizer):
    """Kept in the text, a stop string's start need not be held back (vLLM's rule): every delta is
    all the text so far; the search still finds a stop string that began in earlier tokens."""
    ids = default_tokenizer.encode("The answer is clear. STOP HERE and nothing after it.")
    params = SamplingParams(stop=["STOP HERE"], include_stop_str_in_output=True)
    detokenizer = IncrementalDetokenizer(default_tokenizer, params)
    streamed = ""
    for count, token in enumerate(ids, 1):
        stopped = detokenizer.add_tokens([token])
        streamed += detokenizer.delta(finished=stopped is not None)
        if stopped:
            break
        assert streamed == default_tokenizer.decode(ids[:count])
    assert stopped == "STOP HERE" and streamed == "The answer is clear. STOP HERE"


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    prompt = llm.tokenizer.encode("Once upon a time, in a small village by the sea, there lived an old "
                                  "fisherman who told stories about the", add_special_tokens=True)
    assert len(prompt) > 12
    (truncated,) = generate(llm, [prompt], dataclasses.replace(GREEDY, truncate_prompt_tokens=12))
    (alone,) = generate(llm, [prompt[-12:]], GREEDY)
    assert truncated.prompt_token_ids == prompt[-12:]
    assert truncated.outputs[0].token_ids == alone.outputs[0].token_ids
    (whole,) = generate(llm, [prompt], dataclasses.replace(GREEDY, truncate_prompt_tokens=-1))
    assert whole.prompt_token_ids == prompt  # -1: up to max_model_len, which it is under
    with pytest.raises(InvalidRequestError, match="greater than max_model_len") as error:
        llm.add_request("too-long", prompt, SamplingParams(truncate_prompt_tokens=llm.max_model_len + 1))
    assert error.value.param == "truncate_prompt_tokens"


# ----- validation and isolation ----------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("allowed_token_ids", []),
    ("allowed_token_ids", [-1]),
    ("allowed_token_ids", [10**9]),  # outside the vocabulary: the input processor
    ("bad_words", [""]),
    ("bad_words", [3]),
    ("bad_words", ["x"] * 65),  # over --max-stop-sequences
    ("include_stop_str_in_output", "yes"),
    ("prompt_logprobs", -1),
    ("prompt_logprobs", 21),
    ("truncate_prompt_tokens", 0),
    ("truncate_prompt_tokens", -2),
])
def test_a_bad_value_is_refused_naming_its_field(llm, field, value):
    with pytest.raises(InvalidRequestError) as error:
        llm.add_request(f"bad-{next(_ids)}", PROMPT, SamplingParams(**{field: value}))
    assert error.value.param == field and field in str(error.value)
    assert not llm.has_unfinished_requests()


def test_a_refused_request_leaves_the_others_running(llm):
    prompts = [PROMPT, "A recipe for bread needs", "The three largest planets are"]
    alone = [o.outputs[0].token_ids for o in generate(llm, prompts, GREEDY)]
    ids = [f"r{next(_ids)}" for _ in prompts]
    for request_id, prompt in zip(ids, prompts):
        llm.add_request(request_id, prompt, GREEDY)
    tokens = {i: [] for i in ids}

    def step() -> None:
        for output in llm.step():
            tokens[output.request_id] += output.outputs[0].new_token_ids

    step()  # they run
    with pytest.raises(InvalidRequestError, match="allowed_token_ids"):
        llm.add_request("refused", PROMPT, SamplingParams(allowed_token_ids=[10**9]))
    while llm.has_unfinished_requests():
        step()
    assert [tokens[i] for i in ids] == alone


@pytest.fixture(scope="module")
def core(tiny_gguf):
    return EngineCore(EngineArgs(dtype="float32", **tiny_args(tiny_gguf)))


@pytest.fixture(scope="module")
def healthy_alone(core) -> dict[str, list[int]]:
    """The healthy requests' tokens when nothing else runs."""
    return run(core, healthy_requests())[0]


@pytest.mark.parametrize("change, reason", [
    (dict(allowed_token_ids=[10**7]), "outside the vocabulary"),
    (dict(bad_words=["never tokenized"]), "bad_words were not tokenized"),
    (dict(allowed_token_ids=[2], min_tokens=5, ignore_eos=False), "every token masked"),  # 2 is the EOS
])
def test_a_request_that_reached_the_core_with_a_bad_field_fails_alone(core, healthy_alone, change, reason):
    """Past the frontend's checks (or with masks that leave nothing to sample), the runner
    names the request; every other request finishes with exactly its tokens alone."""
    params = SamplingParams(**{"max_tokens": 10, "temperature": 0.7, **change})
    poisoned = EngineCoreRequest("poisoned", [1200, 1300, 1400], params, 2, arrival_time=3.5)
    tokens, errors = run(core, healthy_requests() + [poisoned])
    assert set(errors) == {"poisoned"} and reason in errors["poisoned"]
    assert tokens.pop("poisoned") == [] and tokens == healthy_alone


# ----- prompt_logprobs ---------------------------------------------------------------------------

def reference_prompt_logprobs(model_dir: str, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax over the vocabulary at each prompt position (row p: token p + 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0].log_softmax(dim=-1)


def assert_prompt_logprobs_match(got: list[TokenLogprobs | None], expected: torch.Tensor, prompt: list[int],
                                 k: int) -> None:
    """Each record: the prompt token's logprob, and k distinct tokens, each with its own logprob,
    none less likely than the reference's k-th (within the tolerance: near-ties may swap)."""
    assert len(got) == len(prompt) and got[0] is None
    for position, record in enumerate(got[1:], 1):
        row = expected[position - 1]
        assert record.token_id == prompt[position]
        assert abs(record.logprob - float(row[prompt[position]])) < 1e-4, position
        assert len({t for t, _ in record.top}) == len(record.top) == k, position
        assert all(abs(value - float(row[token])) < 1e-4 for token, value in record.top), position
        assert min(value for _, value in record.top) > float(row.topk(k).values[-1]) - 1e-4, position


@pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)
@pytest.mark.parametrize("budget, beside", [(16, 0), (32, 2)], ids=["alone", "beside-decodes"])
def test_prompt_logprobs_equal_transformers_with_chunked_prefill_and_a_cached_prefix(tiny_model_dir, budget,
                                                                                     beside):
    """A 40-token prompt in chunks of at most `budget` tokens (beside other requests' decodes):
    every prompt token's logprob and top 5 equal transformers'. The prompt ran before, so the
    prefix cache holds its first blocks, which a prompt_logprobs request does not read."""
    rng = random.Random(5)
    prompt = [rng.randrange(100, 20000) for _ in range(40)]
    expected = reference_prompt_logprobs(tiny_model_dir, prompt)
    llm = LLMEngine(EngineArgs(dtype="float32", model=tiny_model_dir, max_num_batched_tokens=budget, num_kv_blocks=64))
    generate(llm, [prompt], SamplingParams(max_tokens=2, temperature=0.0))  # the prefix cache now holds it
    others = [[rng.randrange(100, 20000) for _ in range(5)] for _ in range(beside)]
    for i, other in enumerate(others):
        llm.add_request(f"other-{i}", other, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    llm.step()  # their prompts are in: they decode beside the chunks below
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=5)
    (output,) = generate(llm, [prompt], params)
    assert output.num_cached_tokens == 0
    assert_prompt_logprobs_match(output.prompt_logprobs, expected, prompt, 5)
    (again,) = generate(llm, [prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert again.num_cached_tokens > 0 and again.prompt_logprobs is None  # the cache did hold the prompt


@pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)
def test_a_one_token_prompt_has_one_none_prompt_logprob(tiny_model_dir):
    llm = LLMEngine(EngineArgs(dtype="float32", model=tiny_model_dir, max_num_batched_tokens=16, num_kv_blocks=16))
    (output,) = generate(llm, [[1234]], SamplingParams(max_tokens=2, prompt_logprobs=0))
    assert output.prompt_logprobs == [None]


@pytest.mark.parametrize("kind, carried_by", [
    (RequestOutputKind.CUMULATIVE, [True, True]),
    (RequestOutputKind.DELTA, [True, False]),  # once, with the first token
    (RequestOutputKind.FINAL_ONLY, [True, True]),  # (the caller keeps only the last)
])
def test_prompt_logprobs_travel_with_the_first_token_to_each_output_kind(default_tokenizer, kind, carried_by):
    processor = OutputProcessor(default_tokenizer)
    params = SamplingParams(max_tokens=4, prompt_logprobs=1, output_kind=kind)
    processor.add_request(EngineCoreRequest("r", [1, 2, 3], params, None, arrival_time=100.0), None)
    records = [None, TokenLogprobs(2, -1.5, [(7, -0.5)]), TokenLogprobs(3, -2.0, [(3, -2.0)])]
    first = processor.process_outputs([EngineCoreOutput("r", [5], None, new_prompt_logprobs=records)], 101.0)
    last = processor.process_outputs([EngineCoreOutput("r", [6], None, "length")], 102.0)
    carried = [output.request_outputs[0].prompt_logprobs == records for output in (first, last)]
    assert carried == carried_by

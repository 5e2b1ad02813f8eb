"""The offline API: on the default SmolLM2 model transformers' greedy tokens and logprobs, answers,
EOS, stops, seeds, aborts and bad input; the same output under every scheduler configuration and
under preemption on the tiny model (on SmolLM2 too in the slow tier; the SLO configurations, which
plan on a real cost curve, on SmolLM2 in every tier)."""

from __future__ import annotations

import pytest
import torch

from chunkserve import LLM, InvalidRequestError, SamplingParams
from tests.engine.support import assert_pool_free
from tests.engine.tiny_llm_support import SMOLLM2, TINY, build_llm, over_models

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
    "List three prime numbers.",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
# The mixed-length prompts (up to 399 tokens) and their 10 tokens fit; 40 blocks of 16 hold it, so the
# preemption test's pool is small enough to preempt yet valid.
TINY_MAX_MODEL_LEN = 512


def chat_prompts(llm: LLM, questions=QUESTIONS) -> list[list[int]]:
    return [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]


def mixed_length_prompts(llm: LLM, count: int = 18) -> list[list[int]]:
    """Natural text of very different lengths (1 to ~400 tokens)."""
    tokenizer = llm.get_tokenizer()
    story = ("The old lighthouse keeper climbed the stairs every evening, counting the steps, "
             "listening to the wind and the gulls, and wondering about the ships far away. ") * 12
    ids = tokenizer.encode(story)
    lengths = [1, 3, 17, 40, 64, 65, 100, 130, 200, 257, 300, 399, 5, 9, 33, 77, 150, 220][:count]
    return [ids[i : i + n] for i, n in enumerate(lengths)]


def test_greedy_tokens_equal_transformers_generate(default_llm, hf_default_model):
    prompts = chat_prompts(default_llm) + [default_llm.get_tokenizer().encode("Once upon a time")]
    outputs = default_llm.generate(prompts, GREEDY)
    for prompt, output in zip(prompts, outputs):
        with torch.inference_mode():
            expected = hf_default_model.generate(
                torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=2, pad_token_id=2
            )[0, len(prompt):].tolist()
        got = output.outputs[0].token_ids
        assert got == expected[: len(got)] and (len(got) == len(expected) or got[-1] == 2)
    assert "Paris" in outputs[0].outputs[0].text
    assert_pool_free(default_llm)


@pytest.fixture(scope="module")
def reference_outputs(request, tiny_gguf):
    """Per model: the mixed-length prompts and their greedy tokens on a budget-64 engine."""
    cache = {}

    def compute(model: str):
        if model not in cache:
            llm = (request.getfixturevalue("default_llm") if model == SMOLLM2 else
                   build_llm(TINY, tiny_gguf, TINY_MAX_MODEL_LEN, max_num_batched_tokens=64, max_num_seqs=32))
            prompts = mixed_length_prompts(llm)
            params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
            cache[model] = prompts, params, [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                                        use_tqdm=False)]
        return cache[model]

    return compute


SCHEDULER_CONFIGURATIONS = {
    "no-chunking": dict(enable_chunked_prefill=False),
    "budget16": dict(max_num_batched_tokens=16, max_num_seqs=16),
    "budget512": dict(max_num_batched_tokens=512),
    "no-mixing": dict(max_num_batched_tokens=64, enable_mixed_batch=False),
    "threshold32": dict(max_num_batched_tokens=128, long_prefill_token_threshold=32, max_num_partial_prefills=3),
    "align64": dict(max_num_batched_tokens=128, chunk_align=64),
    "decreasing": dict(max_num_batched_tokens=256, chunk_schedule="256:64:4:256"),
}
# The SLO configurations plan steps on the start-up profile of the model's cost curve: a random tiny
# model's curve is flat noise, so they run on SmolLM2: the TBT SLO in every tier, the TTFT SLO (whose
# scheduling tests/core checks on a fake predictor) in the long tier. A TBT SLO of 150 ms binds below
# the budget (chunks of ~80 tokens on 2 cores) and keeps chunks above the minimum on a loaded host
# (60 ms cut them to 16 tokens: hundreds of steps when the host is busy).
SLO_CONFIGURATIONS = {
    "tbt-slo": dict(max_num_batched_tokens=256, tbt_slo_ms=150),
    "ttft-slo": dict(ttft_slo_ms=300, long_prefill_token_threshold=64, max_num_partial_prefills=4,
                     max_long_partial_prefills=2),
}


@pytest.mark.parametrize("model, engine_args", [
    *over_models(*SCHEDULER_CONFIGURATIONS.values(), ids=list(SCHEDULER_CONFIGURATIONS)),
    *[pytest.param(SMOLLM2, args, id=f"{SMOLLM2}-{name}", marks=[pytest.mark.slow] if name == "ttft-slo" else [])
      for name, args in SLO_CONFIGURATIONS.items()],
])
def test_outputs_identical_under_every_scheduler_configuration(reference_outputs, tiny_gguf, model, engine_args):
    prompts, params, expected = reference_outputs(model)
    llm = build_llm(model, tiny_gguf, TINY_MAX_MODEL_LEN, **engine_args)
    profiled = llm.engine.engine_core.predictor.fitted  # before any request: the start-up profile ran
    assert llm.engine.engine_core.predictor.margin == 1.0, "the profile's own misses must not set the SLO margin"
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    records = llm.get_step_records()
    assert profiled == ("tbt_slo_ms" in engine_args or "ttft_slo_ms" in engine_args)
    if "tbt_slo_ms" in engine_args:
        slo = engine_args["tbt_slo_ms"] / 1000
        assert all(r.predicted_duration_s <= slo or r.prefill_wait_guard for r in records if r.num_prefill_tokens)
        assert records[-1].prediction_error_p50 is not None
    budget = llm.engine.engine_core.scheduler_config.max_num_batched_tokens
    assert all(r.num_prefill_tokens + r.num_decode_tokens <= budget for r in records)
    modes = {r.forward_mode.value for r in records}
    if engine_args.get("enable_mixed_batch") is False:
        assert "MIXED" not in modes
    elif budget < 512:
        assert "MIXED" in modes
    if budget >= 512:
        assert max(r.num_requests for r in records) >= 16, "expected 16+ requests in flight at once"
    assert_pool_free(llm)


@pytest.mark.parametrize("model, pool", over_models(dict(num_kv_blocks=40, block_size=16)))
def test_preemption_with_a_tiny_pool_keeps_outputs(reference_outputs, tiny_gguf, model, pool):
    prompts, params, expected = reference_outputs(model)
    llm = build_llm(model, tiny_gguf, TINY_MAX_MODEL_LEN, max_num_batched_tokens=64, **pool)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert sum(r.num_preemptions for r in llm.get_step_records()) > 0
    assert_pool_free(llm)


def test_step_records_describe_each_step(default_llm):
    assert default_llm.reset_prefix_cache()  # earlier tests sent these prompts: compute them again
    before = len(default_llm.get_step_records())
    prompts = mixed_length_prompts(default_llm, 6)
    outputs = default_llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    records = default_llm.get_step_records()[before:]
    assert {r.forward_mode.value for r in records} >= {"EXTEND", "MIXED", "DECODE"}
    cached = sum(o.num_cached_tokens for o in outputs)
    assert sum(r.num_prefill_tokens for r in records) == sum(len(p) for p in prompts) - cached
    assert sum(r.prefix_cache_hits for r in records) == cached
    assert sum(r.prefix_cache_queries for r in records) == sum(len(p) for p in prompts)
    assert sum(r.num_decode_tokens for r in records) == sum(5 - 1 for _ in prompts)
    assert all(r.duration_s > 0 and r.num_requests >= 1 for r in records)


def test_metrics_have_one_time_per_token(default_llm):
    output = default_llm.generate("Tell me a story.", SamplingParams(max_tokens=8, ignore_eos=True))[0]
    metrics = output.metrics
    assert len(metrics.token_times) == len(output.outputs[0].token_ids) == 8
    assert metrics.arrival_time <= metrics.first_token_time == metrics.token_times[0]
    assert metrics.token_times == sorted(metrics.token_times)
    assert output.outputs[0].finish_reason == "length"


def test_stop_string_is_cut_from_the_text(default_llm):
    prompt = chat_prompts(default_llm)[0]
    text = default_llm.generate(prompt, GREEDY)[0].outputs[0].text
    stop = text.split()[3]
    output = default_llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, stop=[stop]))[0].outputs[0]
    assert output.finish_reason == "stop" and output.stop_reason == stop
    assert output.text == text[: text.index(stop)]


def test_stop_token_ids_and_min_tokens(default_llm):
    prompt = chat_prompts(default_llm)[1]
    tokens = default_llm.generate(prompt, GREEDY)[0].outputs[0].token_ids
    output = default_llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[tokens[2]]))[0]
    assert output.outputs[0].token_ids == tokens[:3]
    assert (output.outputs[0].finish_reason, output.outputs[0].stop_reason) == ("stop", tokens[2])
    forced = default_llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0, min_tokens=30))[0]
    assert len(forced.outputs[0].token_ids) >= 30
    assert 2 not in forced.outputs[0].token_ids[:30]


def test_eos_stops_unless_ignored(default_llm):
    prompt = chat_prompts(default_llm)[0]
    stopped = default_llm.generate(prompt, SamplingParams(max_tokens=100, temperature=0))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids[-1] == 2
    ignored = default_llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0].outputs[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 30


def test_seeded_sampling_is_reproducible_in_any_batch(default_llm):
    prompt = chat_prompts(default_llm)[1]
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, top_k=50, seed=7, ignore_eos=True)
    alone = default_llm.generate(prompt, seeded)[0].outputs[0].token_ids
    crowd = [SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True) for _ in range(3)]
    batch = default_llm.generate([prompt] * 4, crowd + [seeded], use_tqdm=False)
    assert batch[3].outputs[0].token_ids == alone
    other = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, top_k=50, seed=8, ignore_eos=True)
    assert default_llm.generate(prompt, other)[0].outputs[0].token_ids != alone


def test_abort_mid_generation_frees_everything(default_llm):
    engine = default_llm.engine
    story = SamplingParams(max_tokens=200, ignore_eos=True)  # never ends by itself before the abort
    engine.add_request("to-abort", "Tell me a very long story about dragons.", story)
    engine.add_request("to-finish", "Hello", SamplingParams(max_tokens=3, ignore_eos=True))
    for _ in range(3):
        engine.step()
    aborted = engine.abort_request("to-abort")
    assert aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_free(default_llm)


@pytest.mark.parametrize("prompt, params, message", [
    ("", SamplingParams(), "prompt is empty"),
    ([], SamplingParams(), "prompt is empty"),
    ("\x06", SamplingParams(), "encodes to no tokens"),  # the tokenizer drops the control character
    ([10**9], SamplingParams(), "out of range"),
    ("word " * 9000, SamplingParams(), r"prompt has \d+ tokens, but max_model_len is"),
    ("hi", SamplingParams(max_tokens=10**6), "exceeds max_model_len"),
])
def test_bad_requests_are_refused_and_the_engine_keeps_working(default_llm, prompt, params, message):
    with pytest.raises(InvalidRequestError, match=message):
        default_llm.generate(prompt, params)
    assert not default_llm.engine.has_unfinished_requests()
    assert default_llm.generate("Hi", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    assert_pool_free(default_llm)


@pytest.mark.parametrize("fields, message", [
    (dict(max_tokens=0), "max_tokens must be at least 1"),
    (dict(max_tokens=-3), "max_tokens must be at least 1"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(temperature=-0.5), "temperature must be non-negative"),
    (dict(min_p=2.0), "min_p"),
    (dict(top_k=-2), "top_k"),
])
def test_bad_sampling_values_are_clear_errors(fields, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**fields)


def test_a_failing_prompt_in_a_batch_leaves_nothing_behind(default_llm):
    with pytest.raises(InvalidRequestError):
        default_llm.generate(["fine", "", "also fine"], SamplingParams(max_tokens=3))
    assert not default_llm.engine.has_unfinished_requests()
    assert_pool_free(default_llm)


def test_chat_applies_the_template(default_llm):
    output = default_llm.chat([{"role": "user", "content": "What is the capital of France?"}], GREEDY)[0]
    assert "Paris" in output.outputs[0].text
    assert output.prompt_token_ids[0] == default_llm.get_tokenizer().convert_tokens_to_ids("<|im_start|>")


def test_logprobs_equal_transformers_log_softmax(default_llm, hf_default_model):
    prompt = chat_prompts(default_llm)[2]
    output = default_llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0, logprobs=3))[0].outputs[0]
    tokens = output.token_ids
    with torch.inference_mode():
        logits = hf_default_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    expected = logits.log_softmax(dim=-1)
    assert len(output.logprobs) == len(tokens)
    for row, (token, entries) in enumerate(zip(tokens, output.logprobs)):  # vLLM's: the sampled token, the top 3
        assert entries[token].logprob == pytest.approx(expected[row, token].item(), abs=1e-3)
        top_ids = expected[row].topk(3).indices.tolist()
        assert list(entries) == top_ids and entries[token].rank == 1

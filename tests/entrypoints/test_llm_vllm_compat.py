"""vLLM's offline API as its examples use it: prompt dicts, request defaults from the model's
generation_config.json, --tokenizer and --chat-template."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from chunkserve import LLM, SamplingParams
from chunkserve.config.cpu import auto_dtype
from chunkserve.engine.outputs import Logprob
from chunkserve.errors import InvalidRequestError, ModelLoadError
from chunkserve.sampling_params import RequestOutputKind
from tests.engine.support import save_tiny_llama

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_vllm_prompt_dicts_give_what_the_bare_prompts_give(default_llm):
    text = "The capital of France is"
    ids = default_llm.get_tokenizer().encode(text)
    bare = [o.outputs[0].token_ids for o in default_llm.generate([text, ids], GREEDY, use_tqdm=False)]
    dicts = default_llm.generate([{"prompt": text}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == bare
    single = default_llm.generate({"prompt": text}, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in single] == bare[:1]


@pytest.mark.parametrize("prompt, message", [({"text": "hi"}, "exactly one of 'prompt'"),
                                             ({"prompt": "hi", "prompt_token_ids": [1]}, "exactly one of 'prompt'"),
                                             ({"prompt": "hi", "multi_modal_data": {"image": 1}}, "multimodal")])
def test_a_malformed_prompt_dict_is_refused(default_llm, prompt, message):
    with pytest.raises(InvalidRequestError, match=message):
        default_llm.generate(prompt, GREEDY, use_tqdm=False)


@pytest.fixture(scope="module")
def model_with_generation_config(tmp_path_factory, tiny_model_dir):
    folder = tmp_path_factory.mktemp("with-generation-config")
    shutil.copytree(tiny_model_dir, folder, dirs_exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 20,
                                                               "max_new_tokens": 5, "do_sample": True}))
    return str(folder)


def test_generation_config_sets_the_defaults_as_in_vllm(model_with_generation_config):
    llm = LLM(model_with_generation_config, dtype="float32", kv_cache_memory_gb=0.05)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 20, 5)
    prompt = "One two three"
    (output,) = llm.generate(prompt, use_tqdm=False)
    assert len(output.outputs[0].token_ids) <= 5
    (again,) = llm.generate(prompt, use_tqdm=False)  # greedy: the same answer
    assert again.outputs[0].token_ids == output.outputs[0].token_ids
    plain = LLM(model_with_generation_config, dtype="float32", kv_cache_memory_gb=0.05, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()


def test_a_chat_template_string_or_file_replaces_the_tokenizers(tmp_path, tiny_model_dir):
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    llm = LLM(tiny_model_dir, dtype="float32", kv_cache_memory_gb=0.05, chat_template=template)
    tokenizer = llm.get_tokenizer()
    assert tokenizer.decode(llm.apply_chat_template([{"role": "user", "content": "hi"}])) == "<<hi>>"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    from_file = LLM(tiny_model_dir, dtype="float32", kv_cache_memory_gb=0.05, chat_template=str(path))
    assert from_file.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        llm.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ModelLoadError, match="looks like a file name"):
        LLM(tiny_model_dir, dtype="float32", kv_cache_memory_gb=0.05, chat_template=str(tmp_path / "missing.jinja"))


def test_dtype_auto_loads_as_this_cpus_dtype_and_generates(tiny_model_dir):
    """vLLM's default: bfloat16 where the CPU computes it natively, else float32."""
    llm = LLM(tiny_model_dir, kv_cache_memory_gb=0.05, dtype="auto")
    assert llm.engine.args.dtype == auto_dtype()
    [output] = llm.generate(["Hello"], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 4


def test_chat_takes_vllms_chat_template_fields(default_llm):
    """LLM.chat(..., chat_template=, add_generation_prompt=, continue_final_message=,
    chat_template_kwargs=) as in vLLM: the prompt is transformers' rendering of the same arguments."""
    tokenizer = default_llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=2)
    prefilled = [{"role": "user", "content": "What is the capital of France?"},
                 {"role": "assistant", "content": "The capital of France is"}]
    (continued,) = default_llm.chat(prefilled, params, use_tqdm=False, add_generation_prompt=False,
                                    continue_final_message=True)
    expected = tokenizer.apply_chat_template(prefilled, continue_final_message=True, return_dict=False)
    assert continued.prompt_token_ids == expected
    assert tokenizer.decode(continued.prompt_token_ids).endswith("assistant\nThe capital of France is")
    (same,) = default_llm.generate({"prompt_token_ids": expected}, params, use_tqdm=False)
    assert continued.outputs[0].token_ids == same.outputs[0].token_ids
    with pytest.raises(InvalidRequestError, match="Cannot set both `continue_final_message`"):
        default_llm.chat(prefilled, params, use_tqdm=False, continue_final_message=True)
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{{ suffix }}"
    (templated,) = default_llm.chat(prefilled[:1], params, use_tqdm=False, chat_template=template,
                                    chat_template_kwargs={"suffix": "assistant:"})
    assert tokenizer.decode(templated.prompt_token_ids) == "user: What is the capital of France?\nassistant:"
    assert templated.prompt_token_ids == default_llm.apply_chat_template(
        prefilled[:1], chat_template=template, chat_template_kwargs={"suffix": "assistant:"})


# ----- vLLM's output shape: Logprob dicts, cumulative_logprob, prompt_logprobs, n samples ------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory, default_tokenizer):
    """A tiny random Llama: our LLM on it and transformers' model."""
    folder = tmp_path_factory.mktemp("tiny-llama-compat")
    model = save_tiny_llama(folder, default_tokenizer)
    return LLM(str(folder), dtype="float32", kv_cache_memory_gb=0.05), model


def engine_records(llm: LLM, prompt: list[int], params: SamplingParams):
    """The same request through the engine itself: its finished output, logprobs as the engine's records."""
    engine = llm.engine
    engine.add_request("records", prompt, dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY))
    while True:
        for output in engine.step():
            if output.finished:
                return output


def assert_rank_fits(rank: int, row: torch.Tensor, logprob: float) -> None:
    """`rank` counts the vocabulary's tokens at least as likely, as transformers' row has them (within fp32 noise)."""
    assert int((row > logprob + 1e-4).sum()) + 1 <= rank <= int((row >= logprob - 1e-4).sum())


def test_logprobs_are_vllms_logprob_dicts_with_the_engines_values_and_full_vocabulary_ranks(llama):
    llm, model = llama
    text = llm.get_tokenizer().decode
    prompt = [19556, 665, 1000, 2000, 3000, 4000, 5000]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    (output,) = llm.generate(prompt, params, use_tqdm=False)
    completion = output.outputs[0]
    expected = engine_records(llm, prompt, params)
    with torch.inference_mode():
        rows = model(torch.tensor([prompt + completion.token_ids])).logits[0].log_softmax(-1)
    assert len(completion.logprobs) == len(completion.token_ids) == 6
    for position, (token, entries, record) in enumerate(zip(completion.token_ids, completion.logprobs,
                                                            expected.outputs[0].logprobs)):
        assert all(isinstance(e, Logprob) for e in entries.values())
        assert list(entries)[0] == token == record.token_id  # the sampled token first, then the top 3
        assert {t: e.rank for t, e in list(entries.items())[1:]} == {t: r for r, (t, _) in
                                                                      enumerate(record.top, 1) if t != token}
        assert entries[token].logprob == pytest.approx(record.logprob, abs=1e-6) and entries[token].rank == record.rank
        assert all(entries[t].logprob == pytest.approx(lp, abs=1e-6) for t, lp in record.top)
        assert all(e.decoded_token == text([t]) for t, e in entries.items())
        assert_rank_fits(entries[token].rank, rows[len(prompt) - 1 + position], entries[token].logprob)
    assert completion.cumulative_logprob == pytest.approx(
        sum(entries[t].logprob for t, entries in zip(completion.token_ids, completion.logprobs)), abs=1e-9)
    assert any(e[t].rank > 3 for t, e in zip(completion.token_ids, completion.logprobs)), "no sample outside the top"
    assert len(output.prompt_logprobs) == len(prompt) and output.prompt_logprobs[0] is None
    for position, (token, entries) in enumerate(zip(prompt[1:], output.prompt_logprobs[1:])):
        assert token in entries and sorted(e.rank for t, e in entries.items() if t != token)[:2] in ([1, 2], [1])
        assert_rank_fits(entries[token].rank, rows[position], entries[token].logprob)
    (plain,) = llm.generate(prompt, dataclasses.replace(params, logprobs=None, prompt_logprobs=None), use_tqdm=False)
    assert (plain.outputs[0].logprobs, plain.outputs[0].cumulative_logprob, plain.prompt_logprobs) == (None, None, None)


def test_n_samples_come_as_one_output_seeded_seed_plus_i_with_the_prompt_computed_once(llama):
    llm, _ = llama
    prompt = list(range(7000, 7040))  # 40 tokens: the later samples read its 2 full blocks of 16
    params = SamplingParams(n=3, seed=11, max_tokens=5, temperature=1.0, ignore_eos=True)
    before = len(llm.get_step_records())
    (output,) = llm.generate(prompt, params, use_tqdm=False)
    records = llm.get_step_records()[before:]
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in output.outputs}) == 3
    hit = (len(prompt) - 1) // 16 * 16
    assert sum(r.prefix_cache_hits for r in records) == 2 * hit
    assert sum(r.num_prefill_tokens for r in records) == len(prompt) + 2 * (len(prompt) - hit)
    assert output.num_cached_tokens == 0  # the first sample's: it computed the prompt
    (again,) = llm.generate(prompt, params, use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in output.outputs]
    (second,) = llm.generate(prompt, dataclasses.replace(params, n=1, seed=12), use_tqdm=False)
    assert second.outputs[0].token_ids == output.outputs[1].token_ids


def test_best_of_other_than_n_is_refused_as_vllm_v1_dropped_it(llama):
    llm, _ = llama
    assert SamplingParams(n=2, best_of=2).best_of == 2
    with pytest.raises(InvalidRequestError, match="best_of must be None or equal to n") as error:
        SamplingParams(n=2, best_of=3)
    assert error.value.param == "best_of"
    with pytest.raises(InvalidRequestError, match="n must be at least 1"):
        SamplingParams(n=0)
    with pytest.raises(InvalidRequestError, match="an engine request is one sample"):
        llm.engine.add_request("two", [1, 2, 3], SamplingParams(n=2))

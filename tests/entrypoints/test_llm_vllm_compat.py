"""vLLM's offline API as its examples use it: prompt dicts, request defaults from the model's
generation_config.json, --tokenizer and --chat-template."""

from __future__ import annotations

import json
import shutil

import pytest

from chunkserve import LLM, SamplingParams
from chunkserve.errors import InvalidRequestError, ModelLoadError

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
    llm = LLM(model_with_generation_config, kv_cache_memory_gb=0.05)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 20, 5)
    prompt = "One two three"
    (output,) = llm.generate(prompt, use_tqdm=False)
    assert len(output.outputs[0].token_ids) <= 5
    (again,) = llm.generate(prompt, use_tqdm=False)  # greedy: the same answer
    assert again.outputs[0].token_ids == output.outputs[0].token_ids
    plain = LLM(model_with_generation_config, kv_cache_memory_gb=0.05, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()


def test_a_chat_template_string_or_file_replaces_the_tokenizers(tmp_path, tiny_model_dir):
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    llm = LLM(tiny_model_dir, kv_cache_memory_gb=0.05, chat_template=template)
    tokenizer = llm.get_tokenizer()
    assert tokenizer.decode(llm.apply_chat_template([{"role": "user", "content": "hi"}])) == "<<hi>>"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    from_file = LLM(tiny_model_dir, kv_cache_memory_gb=0.05, chat_template=str(path))
    assert from_file.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        llm.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ModelLoadError, match="looks like a file name"):
        LLM(tiny_model_dir, kv_cache_memory_gb=0.05, chat_template=str(tmp_path / "missing.jinja"))


def test_dtype_auto_loads_as_float32(tiny_model_dir):
    llm = LLM(tiny_model_dir, kv_cache_memory_gb=0.05, dtype="auto")
    assert llm.engine.args.dtype == "float32"

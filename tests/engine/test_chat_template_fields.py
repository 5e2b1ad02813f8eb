"""vLLM's per-request chat-template fields in the input processor (chat_template,
chat_template_kwargs, continue_final_message, add_special_tokens, documents): the prompt's
token ids equal transformers' own apply_chat_template with the same arguments, and a bad
combination or template is refused naming its field."""

from __future__ import annotations

import copy

import pytest

from chunkserve.engine.input_processor import InputProcessor
from chunkserve.errors import InvalidRequestError
from tests.engine.support import LIMIT, processor

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PREFILLED = [*CHAT, {"role": "assistant", "content": "The capital of France is"}]
# prints a kwarg (enable_thinking, as Qwen3's template reads it) and the documents, if given
TEMPLATE = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if documents %}{% for d in documents %}<doc {{ d['title'] }}>{{ d['text'] }}</doc>{% endfor %}"
            "{% endif %}{% if add_generation_prompt %}[assistant]{% if enable_thinking is defined and not "
            "enable_thinking %} /no_think{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def chat(default_tokenizer) -> InputProcessor:
    return processor(default_tokenizer)


def hf_ids(tokenizer, messages, **kwargs) -> list[int]:
    """transformers' own token ids (its tokenize=True path)."""
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_models_template_gives_transformers_ids(chat, add_generation_prompt):
    assert chat.apply_chat_template(CHAT, add_generation_prompt) == \
        hf_ids(chat.tokenizer, CHAT, add_generation_prompt=add_generation_prompt)


def test_a_request_chat_template_replaces_the_models(chat):
    ids = chat.apply_chat_template(CHAT, chat_template=TEMPLATE)
    assert ids == hf_ids(chat.tokenizer, CHAT, chat_template=TEMPLATE, add_generation_prompt=True)
    assert chat.tokenizer.decode(ids).startswith("[user] What is the capital")
    assert ids != chat.apply_chat_template(CHAT)


def test_chat_template_kwargs_reach_the_template_and_override_the_other_fields(chat):
    """vLLM lays chat_template_kwargs over add_generation_prompt, continue_final_message and
    chat_template: a kwarg of one of those names wins."""
    tokenizer = chat.tokenizer
    off = chat.apply_chat_template(CHAT, chat_template=TEMPLATE, chat_template_kwargs={"enable_thinking": False})
    assert off == hf_ids(tokenizer, CHAT, chat_template=TEMPLATE, add_generation_prompt=True, enable_thinking=False)
    assert tokenizer.decode(off).endswith("[assistant] /no_think")
    on = chat.apply_chat_template(CHAT, chat_template=TEMPLATE, chat_template_kwargs={"enable_thinking": True})
    assert tokenizer.decode(on).endswith("[assistant]")
    assert chat.apply_chat_template(CHAT, chat_template_kwargs={"add_generation_prompt": False}) == \
        chat.apply_chat_template(CHAT, False)
    assert chat.apply_chat_template(CHAT, chat_template_kwargs={"chat_template": TEMPLATE}) == \
        chat.apply_chat_template(CHAT, chat_template=TEMPLATE)


def test_documents_reach_the_template(chat):
    documents = [{"title": "paris", "text": "Paris is the capital."}]
    ids = chat.apply_chat_template(CHAT, chat_template=TEMPLATE, documents=documents)
    assert ids == hf_ids(chat.tokenizer, CHAT, chat_template=TEMPLATE, documents=documents,
                         add_generation_prompt=True)
    assert "<doc paris>Paris is the capital.</doc>" in chat.tokenizer.decode(ids)


def test_continue_final_message_leaves_the_last_message_open(chat):
    ids = chat.apply_chat_template(PREFILLED, False, continue_final_message=True)
    assert ids == hf_ids(chat.tokenizer, PREFILLED, continue_final_message=True)
    assert chat.tokenizer.decode(ids).endswith("<|im_start|>assistant\nThe capital of France is")
    closed = chat.apply_chat_template(PREFILLED, False)
    assert closed[:len(ids)] == ids and chat.tokenizer.decode(closed[len(ids):]).startswith("<|im_end|>")


@pytest.mark.parametrize("options", [{"continue_final_message": True},
                                     {"chat_template_kwargs": {"continue_final_message": True}}])
def test_continue_final_message_with_add_generation_prompt_is_refused_with_vllms_message(chat, options):
    with pytest.raises(InvalidRequestError) as refused:
        chat.apply_chat_template(PREFILLED, True, **options)
    assert str(refused.value) == "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
    assert refused.value.param == "continue_final_message"


def test_add_special_tokens_encodes_the_rendered_text_with_bos(default_tokenizer):
    with_bos = copy.deepcopy(default_tokenizer)
    with_bos.add_bos_token = True  # this tokenizer's encode then starts with BOS
    chat = processor(with_bos)
    plain = chat.apply_chat_template(CHAT)
    assert plain == hf_ids(with_bos, CHAT, add_generation_prompt=True)  # the template writes its own BOS
    text = with_bos.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert chat.apply_chat_template(CHAT, add_special_tokens=True) == with_bos.encode(text) == \
        [with_bos.bos_token_id, *plain]
    request, _ = chat.process("r", "Hello there")
    assert request.prompt_token_ids[0] == with_bos.bos_token_id
    request, _ = chat.process("r", "Hello there", add_special_tokens=False)
    assert request.prompt_token_ids == with_bos.encode("Hello there", add_special_tokens=False)


@pytest.mark.parametrize("options, field, message", [
    ({"chat_template": "{% for m in messages %}"}, "chat_template", "chat_template failed"),
    ({"chat_template": "{{ raise_exception('no system messages') }}"}, "chat_template", "no system messages"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", "unexpected chat template kwargs"),
    ({"chat_template_kwargs": {"chat_template": 3}}, "chat_template", "must be a string"),
    ({"chat_template": "x" * (LIMIT + 1)}, "chat_template", "--max-prompt-chars"),
    ({"chat_template": "{% for i in range(9999) %}many {% endfor %}"}, "chat_template", "template's text has"),
    ({"documents": [{"text": "d" * LIMIT}]}, "messages", "--max-prompt-chars"),
])
def test_a_bad_template_or_option_is_refused_naming_its_field(chat, options, field, message):
    with pytest.raises(InvalidRequestError, match=message) as refused:
        chat.apply_chat_template(CHAT, **options)
    assert refused.value.param == field


def test_the_models_template_refusing_the_messages_names_messages(chat):
    with pytest.raises(InvalidRequestError, match="refused the messages") as refused:
        chat.apply_chat_template([{"role": "user", "content": None}])  # the template concatenates content
    assert refused.value.param == "messages"

"""Images in /v1/chat/completions and /tokenize bodies: OpenAI's content parts in each form vLLM
takes reach the input processor in order, and a model that takes no images answers 400 naming
the part (no request reaches the engine)."""

from __future__ import annotations

import json

import pydantic
import pytest

from chunkserve.engine.chat_content import split_images
from chunkserve.entrypoints.server.openai_protocol import ChatCompletionRequest
from tests.multimodal_models import png_data_url, random_image


def body(*parts) -> dict:
    return {"messages": [{"role": "user", "content": list(parts)}]}


def test_the_body_keeps_text_and_image_parts_in_order():
    data_url = png_data_url(random_image(1))
    request = ChatCompletionRequest.model_validate_json(json.dumps(body(
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": data_url, "detail": "high"}},
        {"type": "text", "text": "b"}, {"type": "image_url", "image_url": "file:///media/x.png"})))
    messages, images = split_images([m.as_template_message() for m in request.messages])
    assert messages[0]["content"] == [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"},
                                      {"type": "image"}]
    assert [(i.param, i.url) for i in images] == [("messages[0].content[1]", data_url),
                                                  ("messages[0].content[3]", "file:///media/x.png")]
    text_only = ChatCompletionRequest.model_validate_json(json.dumps(body({"type": "text", "text": "a"},
                                                                          {"type": "text", "text": "b"})))
    assert text_only.messages[0].as_template_message()["content"] == "ab"  # as before: text parts joined


@pytest.mark.parametrize("part", [{"type": "image_url"}, {"type": "image_url", "image_url": {"uri": "x"}},
                                  {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}])
def test_a_malformed_part_is_refused_by_the_body(part):
    with pytest.raises(pydantic.ValidationError):
        ChatCompletionRequest.model_validate_json(json.dumps(body(part)))


def test_a_text_only_model_answers_400_naming_the_image_part(tiny_delayed_server):
    image = {"type": "image_url", "image_url": {"url": png_data_url(random_image(2))}}
    with tiny_delayed_server.client() as http:
        for path in ("/v1/chat/completions", "/tokenize"):
            answer = http.post(path, json=body({"type": "text", "text": "what is it?"}, image))
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert "does not take images" in error["message"] and error["param"] == "messages[0].content[1]"

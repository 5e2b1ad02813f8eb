"""OpenAI's chat content parts in every form vLLM takes, mixed in any order: the images come out
in order, each named by its part, and the template gets {"type": "image"} in their place."""

from __future__ import annotations

import pytest

from chunkserve.engine.chat_content import split_images
from chunkserve.errors import InvalidRequestError
from tests.multimodal_models import random_image


def test_parts_of_every_form_keep_their_order():
    pil = random_image(1)
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAA", "detail": "low"}},
            {"type": "text", "text": "compare"},
            {"type": "image_url", "image_url": "file:///media/b.png"},
        ]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "and"}, {"type": "image_pil", "image_pil": pil}]},
    ]
    rendered, images = split_images(messages)
    assert rendered[0] is messages[0] and rendered[2] is messages[2]
    assert rendered[1]["content"] == [{"type": "image"}, {"type": "text", "text": "compare"}, {"type": "image"}]
    assert rendered[3]["content"] == [{"type": "text", "text": "and"}, {"type": "image"}]
    assert [(i.param, i.url) for i in images] == [("messages[1].content[0]", "data:image/png;base64,AAA"),
                                                  ("messages[1].content[2]", "file:///media/b.png"),
                                                  ("messages[3].content[1]", None)]
    assert images[2].image is pil


def test_text_only_content_lists_are_left_as_they_are():
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert split_images(messages) == (messages, [])


@pytest.mark.parametrize("part, message", [
    ({"type": "image_url", "image_url": {}}, "needs image_url"),
    ({"type": "image_pil", "image_pil": "not an image"}, "needs image_pil"),
    ({"type": "input_audio", "input_audio": {}}, "'input_audio' is not supported"),
    ({"type": "text"}, "needs text"),
])
def test_a_malformed_part_is_refused_naming_it(part, message):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": "data:image/png;base64,A"}, part]}]
    with pytest.raises(InvalidRequestError, match=message) as error:
        split_images(messages)
    assert error.value.param == "messages[0].content[1]"

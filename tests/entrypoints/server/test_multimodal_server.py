"""A vision-language model served end to end (a real server process on a tiny random LLaVA),
through the `openai` client as a vLLM user sends images: data URLs and file:// paths under
--allowed-local-media-path, streamed or not; /tokenize counts the image's placeholder tokens as
the completion's usage does; a repeated image reads its prompt from the prefix cache and answers
the same; the encoder's counters reach /metrics; more images than --limit-mm-per-prompt, or a
file outside the allowed folder, is a 400 naming the part."""

from __future__ import annotations

import json

import openai
import pytest

from tests.multimodal_models import build_vlm, png_data_url, random_image, save_png
from tests.server_process import API_KEY, start_server, stop_server


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("media")
    save_png(random_image(21), str(folder), "cat.png")
    return str(folder)


@pytest.fixture(scope="module")
def server(tmp_path_factory, media):
    model = build_vlm("llava", str(tmp_path_factory.mktemp("llava")))
    server = start_server(tmp_path_factory, "--model", model, "--max-model-len", "256", "--max-num-batched-tokens",
                          "16", "--allowed-local-media-path", media, "--limit-mm-per-prompt", '{"image": 2}',
                          "--served-model-name", "tiny-llava", name="vlm")
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)


def asking(*urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, *parts]}]


def ask(client: openai.OpenAI, messages: list[dict], **kwargs):
    return client.chat.completions.create(model="tiny-llava", messages=messages, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True}, **kwargs)


def test_a_data_url_image_is_answered_and_a_repeat_reads_the_prefix_cache(server, client):
    messages = asking(png_data_url(random_image(20)))
    first = ask(client, messages)
    again = ask(client, messages)
    assert first.usage.completion_tokens == 8
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    with server.client() as http:
        counted = http.post("/tokenize", json={"model": "tiny-llava", "messages": messages}).json()
    assert counted["count"] == first.usage.prompt_tokens  # the image's 16 placeholder tokens included
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in ask(client, messages, stream=True)
                       if chunk.choices)
    assert streamed == first.choices[0].message.content


def test_a_local_file_under_the_allowed_folder_is_read_and_the_encoder_counts_show(server, client, media):
    answer = ask(client, asking(f"file://{media}/cat.png"))
    assert answer.usage.completion_tokens == 8
    with server.admin_client() as http:
        metrics = http.get("/metrics").text
    encoded = [line for line in metrics.splitlines() if line.startswith("chunkserve:encoder_inputs_total")]
    assert encoded and float(encoded[0].split()[-1]) >= 2  # the data-URL image (once) and the file's


@pytest.mark.parametrize("urls, message, param", [
    (["file:///etc/hostname"], "allowed-local-media-path", "messages[0].content[1]"),
    (["https://example.com/cat.png"], "allowed-media-domains", "messages[0].content[1]"),
    (["data:image/png;base64,bm90IGFuIGltYWdl"], "image", "messages[0].content[1]"),
    ([png_data_url(random_image(i)) for i in range(3)], "limit", "messages"),
])
def test_bad_images_are_400_naming_the_part(client, urls, message, param):
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, asking(*urls))
    error = json.loads(refused.value.response.text)["error"]
    assert message in error["message"] and (error["param"] or "").startswith(param), error

"""vLLM's quick start, run unchanged against chunkserve: `serve MODEL_ID` with the id in the local
Hugging Face cache, then the client code of vLLM's docs/getting_started/quickstart.md and of
examples/online_serving/openai_completion_client.py and openai_chat_completion_client.py, word
for word but for the command's name and the port (tests may run beside other servers). The
model behind the id is a tiny random Llama with SmolLM2's tokenizer: the point is the interface."""

from __future__ import annotations

import os
import shutil
import sys

import httpx
import pytest
from openai import OpenAI

from tests.hostile_server import build_tiny_model
from tests.server_process import start_command, stop_server, wait_until_up

MODEL_ID = "Qwen/Qwen2.5-1.5B-Instruct"  # the quick start's model
REVISION = "0123456789abcdef0123456789abcdef01234567"


def put_in_hub_cache(model_dir: str, hub_cache: str) -> None:
    """The cache's own layout, as `huggingface-cli download` leaves it."""
    repo = os.path.join(hub_cache, "models--" + MODEL_ID.replace("/", "--"))
    shutil.copytree(model_dir, os.path.join(repo, "snapshots", REVISION))
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as ref:
        ref.write(REVISION)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> str:
    cache = str(tmp_path_factory.mktemp("hub"))
    put_in_hub_cache(build_tiny_model(str(tmp_path_factory.mktemp("quickstart-model"))), cache)
    return cache


@pytest.fixture(scope="module")
def quickstart_server(hub_cache, tmp_path_factory):
    env = {**os.environ, "HF_HUB_CACHE": hub_cache, "OMP_NUM_THREADS": "1", "CHUNKSERVE_API_KEY": "",
           "CHUNKSERVE_ADMIN_API_KEY": ""}
    env.pop("VLLM_API_KEY", None)
    # `vllm serve Qwen/Qwen2.5-1.5B-Instruct` (the harness adds --port)
    server = start_command(tmp_path_factory, [sys.executable, "-m", "chunkserve.entrypoints.cli", "serve", MODEL_ID],
                           name="quickstart", env=env, wait=False)
    server.base_url = f"http://localhost:{server.service.port}"
    yield wait_until_up(server)
    stop_server(server)


def test_the_quickstart_curl_requests(quickstart_server):
    base = quickstart_server.base_url
    models = httpx.get(f"{base}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL_ID]
    completion = httpx.post(f"{base}/v1/completions", headers={"Content-Type": "application/json"}, json={
        "model": MODEL_ID, "prompt": "San Francisco is a", "max_tokens": 7, "temperature": 0})
    assert completion.status_code == 200, completion.text
    body = completion.json()
    assert body["model"] == MODEL_ID and body["usage"]["completion_tokens"] <= 7 and body["choices"][0]["text"]
    chat = httpx.post(f"{base}/v1/chat/completions", headers={"Content-Type": "application/json"}, json={
        "model": MODEL_ID, "messages": [{"role": "system", "content": "You are a helpful assistant."},
                                        {"role": "user", "content": "Who won the world series in 2020?"}]})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["role"] == "assistant"


def test_the_quickstart_openai_client_code(quickstart_server):
    openai_api_key = "EMPTY"
    openai_api_base = f"{quickstart_server.base_url}/v1"
    client = OpenAI(api_key=openai_api_key, base_url=openai_api_base)
    completion = client.completions.create(model=MODEL_ID, prompt="San Francisco is a")
    assert completion.choices[0].text and completion.usage.completion_tokens <= 16  # OpenAI's default max_tokens
    chat_response = client.chat.completions.create(
        model=MODEL_ID,
        messages=[{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "Tell me a joke."}],
    )
    assert chat_response.choices[0].message.content is not None
    assert chat_response.choices[0].finish_reason in ("stop", "length")


def test_the_completion_client_example_streamed_and_not(quickstart_server):
    client = OpenAI(api_key="EMPTY", base_url=f"{quickstart_server.base_url}/v1")
    model = client.models.list().data[0].id
    streamed = list(client.completions.create(model=model, prompt="A robot may not injure a human being",
                                              echo=False, stream=True))
    assert streamed[-1].choices[0].finish_reason == "length" and len(streamed) == 16
    # the lines the example leaves commented out, switched on
    completion = client.completions.create(model=model, prompt="A robot may not injure a human being", echo=False,
                                           n=2, stream=False, logprobs=3)
    assert [c.index for c in completion.choices] == [0, 1]
    for choice in completion.choices:
        assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) > 0
        assert all(1 <= len(top) <= 4 for top in choice.logprobs.top_logprobs)  # the top 3 and the sampled one


def test_the_chat_client_example(quickstart_server):
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Who won the world series in 2020?"},
                {"role": "assistant", "content": "The Los Angeles Dodgers won the World Series in 2020."},
                {"role": "user", "content": "Where was it played?"}]
    client = OpenAI(api_key="EMPTY", base_url=f"{quickstart_server.base_url}/v1")
    model = client.models.list().data[0].id
    chat_completion = client.chat.completions.create(messages=messages, model=model)
    assert chat_completion.model == MODEL_ID and chat_completion.usage.prompt_tokens > 30
    chunks = list(client.chat.completions.create(messages=messages, model=model, stream=True, max_tokens=5))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason is not None


def test_the_offline_quickstart(hub_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", hub_cache)
    from chunkserve import LLM, SamplingParams

    prompts = ["Hello, my name is", "The president of the United States is", "The capital of France is",
               "The future of AI is"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    llm = LLM(dtype="float32", model=MODEL_ID)
    outputs = llm.generate(prompts, sampling_params)
    assert [output.prompt for output in outputs] == prompts
    assert all(output.outputs[0].text for output in outputs)

"""The HTTP API through the official openai client and raw HTTP: the same text as the offline
engine, streaming per token, disconnects, errors, auth, metrics.

The protocol is checked on a server on the tiny model (tests/tiny_model.py) against an in-process
engine with the same flags; only what needs real weights (an answer, the default model's name)
asks the session SmolLM2 `server`."""

from __future__ import annotations

import asyncio
import json
import os
import re

import httpx
import openai
import pytest

from chunkserve import SamplingParams
from tests.entrypoints.server.tiny_server_support import tiny_offline_llm
from tests.server_process import API_KEY, MAX_BODY_BYTES

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


@pytest.fixture(scope="module")
def tiny_server(tiny_delayed_server):
    """Each of its steps sleeps STEP_DELAY_MS: a stream the test acts on is still decoding then."""
    return tiny_delayed_server


@pytest.fixture(scope="module")
def tiny_llm(tiny_gguf):
    return tiny_offline_llm(tiny_gguf)


@pytest.fixture(scope="module")
def model_name(tiny_server) -> str:
    return tiny_server.client().get("/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key=API_KEY)


def offline_texts(llm, prompts, max_tokens: int) -> list[str]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]


def test_completion_equals_the_offline_engine(client, model_name, tiny_llm):
    prompt = "The capital of France is"
    response = client.completions.create(model=model_name, prompt=prompt, max_tokens=12, temperature=0)
    choice = response.choices[0]
    assert choice.text == offline_texts(tiny_llm, [prompt], 12)[0]
    assert response.usage.prompt_tokens == len(tiny_llm.get_tokenizer().encode(prompt))
    assert response.usage.completion_tokens == 12 and choice.finish_reason == "length"


def test_completion_prompt_forms_and_echo(client, model_name, tiny_llm):
    ids = tiny_llm.get_tokenizer().encode("Once upon a time")
    batch = client.completions.create(model=model_name, prompt=["Hello", "Once upon a time"], max_tokens=6,
                                      temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == offline_texts(tiny_llm, ["Hello", ids], 6)
    from_ids = client.completions.create(model=model_name, prompt=[ids, ids[:2]], max_tokens=6, temperature=0)
    assert [c.text for c in from_ids.choices] == offline_texts(tiny_llm, [ids, ids[:2]], 6)
    echoed = client.completions.create(model=model_name, prompt="Hello", max_tokens=4, temperature=0, echo=True)
    text = echoed.choices[0].text
    assert text.startswith("Hello") and len(text) > 5 and batch.choices[0].text.startswith(text[5:])


@pytest.mark.parametrize("stream", [False, True])
def test_an_echo_with_no_tokens_returns_the_prompt_and_its_logprobs(tiny_server, model_name, tiny_llm, stream):
    """vLLM's answer to echo with max_tokens 0 (scoring a text): the prompt, its tokens'
    logprobs (none for the first), nothing generated; usage counts the one token vLLM samples
    and leaves out. Without echo, max_tokens 0 is a 400 naming it."""
    prompt = "Once upon a time"
    prompt_ids = tiny_llm.get_tokenizer().encode(prompt)
    body = {"model": model_name, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "stream": stream}
    with tiny_server.client() as http:
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        if stream:
            events = [json.loads(line[len("data: "):]) for line in response.text.splitlines()
                      if line.startswith("data: {")]
            choices = [event["choices"][0] for event in events if event["choices"]]
            text = "".join(choice["text"] for choice in choices)
            logprobs = [value for choice in choices for value in choice["logprobs"]["token_logprobs"]]
        else:
            choice = response.json()["choices"][0]
            text, logprobs = choice["text"], choice["logprobs"]["token_logprobs"]
            assert choice["finish_reason"] == "length" and response.json()["usage"]["completion_tokens"] == 1
        assert text == prompt
        assert len(logprobs) == len(prompt_ids) and logprobs[0] is None and all(v < 0 for v in logprobs[1:])
        refused = http.post("/v1/completions", json={**body, "echo": False})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_streamed_completion_sends_one_chunk_per_token(client, model_name, tiny_llm):
    prompt = "Once upon a time"
    chunks = list(client.completions.create(model=model_name, prompt=prompt, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    token_chunks = [c for c in chunks if c.choices]
    assert len(token_chunks) == 10
    assert "".join(c.choices[0].text for c in token_chunks) == offline_texts(tiny_llm, [prompt], 10)[0]
    assert token_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 10


def test_chat_equals_the_offline_chat(client, model_name, tiny_llm):
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    expected = tiny_llm.chat(messages, SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)[0]
    response = client.chat.completions.create(model=model_name, messages=messages, max_tokens=20, temperature=0)
    assert response.choices[0].message.content == expected.outputs[0].text
    stream = client.chat.completions.create(model=model_name, messages=messages, max_tokens=20, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == expected.outputs[0].finish_reason


def test_a_chat_stream_sends_its_role_chunk_with_the_first_token(tiny_server, model_name):
    """vLLM sends the {"role": "assistant"} chunk with the first output, and clients (vLLM's
    `bench serve --backend openai-chat`) time the first chunk as the TTFT: sent when the stream
    opened, it would arrive while the prompt still prefills (a long prompt here, over several
    delayed steps). When it arrives, the server has already counted the request's first token."""
    ttft_key = "chunkserve:time_to_first_token_seconds_count{}"
    before = tiny_server.wait_until(lambda m: m["chunkserve:num_requests_running{}"] == 0)
    body = {"model": model_name, "messages": [{"role": "user", "content": " ".join(["word"] * 300)}],
            "max_tokens": 3, "stream": True}
    with tiny_server.client() as http, http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = (line for line in response.iter_lines() if line.startswith("data: "))
        first = json.loads(next(lines)[len("data: "):])
        counted = tiny_server.metrics()[ttft_key] - before[ttft_key]
        rest = [line for line in lines]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert counted == 1
    assert rest[-1] == "data: [DONE]"


def test_the_default_model_answers_and_is_named_after_its_file(server):
    """Real weights: SmolLM2 through the server's chat template knows the answer, and the
    default server names the model it loaded."""
    with server.client() as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        assert model.startswith("SmolLM2-135M-Instruct")
        response = http.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": 20,
            "temperature": 0})
    assert response.status_code == 200 and "Paris" in response.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("fields", [{"chat_template": "{{ messages }}"},
                                    {"chat_template_kwargs": {"chat_template": "{{ messages }}"}}])
def test_a_request_chat_template_needs_trust_request_chat_template(client, model_name, tiny_server, fields):
    """As vLLM: a template from the request is code the server would run."""
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError, match="--trust-request-chat-template is not set"):
        client.chat.completions.create(model=model_name, messages=messages, max_tokens=1, extra_body=fields)
    with tiny_server.client() as http:
        refused = http.post("/tokenize", json={"messages": messages, **fields})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    kwargs = client.chat.completions.create(model=model_name, messages=messages, max_tokens=1,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert kwargs.usage.prompt_tokens > 0  # kwargs alone need no trust


def test_logprobs_describe_the_sampled_tokens(client, model_name):
    response = client.completions.create(model=model_name, prompt="1, 2, 3,", max_tokens=5, temperature=0, logprobs=3)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert "".join(logprobs.tokens) == response.choices[0].text
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) == 3 and logprob <= 0
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the sampled token is the most likely
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(entry.top_logprobs) == 2 for entry in content)


def test_sixteen_concurrent_streams_each_get_the_offline_text(tiny_server, model_name, tiny_llm):
    tokenizer = tiny_llm.get_tokenizer()
    story = tokenizer.encode("The lighthouse keeper counted the steps every night and listened to the sea. " * 20)
    prompts = [story[i : i + n] for i, n in enumerate([3, 9, 20, 33, 47, 64, 80, 101, 130, 150, 170, 200,
                                                       230, 260, 300, 5])]
    expected = offline_texts(tiny_llm, prompts, 16)

    async def stream_one(client: openai.AsyncOpenAI, prompt: list[int]) -> str:
        stream = await client.completions.create(model=model_name, prompt=prompt, max_tokens=16, temperature=0,
                                                 stream=True)
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{tiny_server.base_url}/v1", api_key=API_KEY) as client:
            return await asyncio.gather(*(stream_one(client, p) for p in prompts))

    assert asyncio.run(run_all()) == expected


def test_sglang_generate(tiny_server, tiny_llm):
    with tiny_server.client() as http:
        body = http.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 6,
                                                                                 "temperature": 0}}).json()
        assert body["text"] == offline_texts(tiny_llm, ["Hello"], 6)[0]
        assert body["meta_info"]["completion_tokens"] == len(body["output_ids"]) == 6
        assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
        with http.stream("POST", "/generate", json={"input_ids": [1, 2, 3], "stream": True,
                                                    "sampling_params": {"max_new_tokens": 4}}) as response:
            events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) == 5
    assert len(json.loads(events[-2][6:])["output_ids"]) == 4


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(tiny_server):
    before = tiny_server.metrics()
    aborted_key = "chunkserve:request_success_total{finished_reason=abort}"
    body = {"prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with tiny_server.client() as http, http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]  # three events with their blank separators
        events = [json.loads(line[6:]) for line in received if line.startswith("data: ")]
        assert len(events) == 3 and all(e["choices"][0]["finish_reason"] is None for e in events)  # mid-stream
    metrics = tiny_server.wait_until(lambda m: m[aborted_key] == before[aborted_key] + 1)
    assert metrics["chunkserve:kv_cache_free_blocks{}"] == metrics["chunkserve:kv_cache_total_blocks{}"]
    assert metrics["chunkserve:num_requests_running{}"] == 0


def test_metrics_counters_agree_with_what_was_sent(tiny_server, client, model_name, tiny_llm):
    prompts = ["One", "Two three", "Four five six seven"]
    before = tiny_server.wait_until(lambda m: m["chunkserve:num_requests_running{}"] == 0)
    for prompt in prompts:
        client.completions.create(model=model_name, prompt=prompt, max_tokens=5, extra_body={"ignore_eos": True})
    after = tiny_server.metrics()

    def delta(name: str) -> float:
        return after[name] - before[name]

    prompt_tokens = sum(len(tiny_llm.get_tokenizer().encode(p)) for p in prompts)
    assert delta("chunkserve:prompt_tokens_total{}") == prompt_tokens
    assert delta("chunkserve:generation_tokens_total{}") == 15
    assert delta("chunkserve:request_success_total{finished_reason=length}") == 3
    assert delta("chunkserve:time_to_first_token_seconds_count{}") == 3
    assert delta("chunkserve:inter_token_latency_seconds_count{}") == 12
    assert delta("chunkserve:e2e_request_latency_seconds_count{}") == 3
    steps = sum(delta(f"chunkserve:engine_steps_total{{forward_mode={m}}}") for m in ("EXTEND", "MIXED", "DECODE"))
    assert steps >= 5 and delta("chunkserve:step_decode_batch_size_sum{}") == 12
    assert after["chunkserve:kv_cache_free_blocks{}"] == after["chunkserve:kv_cache_total_blocks{}"]


def test_prefix_cache_hits_show_in_usage_and_metrics_and_reset_waits_for_idle(tiny_server, client, model_name):
    prompt = list(range(1000, 1100))
    idle = tiny_server.wait_until(lambda m: m["chunkserve:num_requests_running{}"] == 0
                             and m["chunkserve:num_requests_waiting{}"] == 0)
    with tiny_server.admin_client() as admin:
        assert admin.post("/reset_prefix_cache").status_code == 200
    first = client.completions.create(model=model_name, prompt=prompt, max_tokens=2)
    longer = client.completions.create(model=model_name, prompt=prompt + [7, 8, 9], max_tokens=2)
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert longer.usage.prompt_tokens_details.cached_tokens == 96  # 6 full blocks of 16
    assert chat.usage.prompt_tokens_details.cached_tokens % 16 == 0
    after = tiny_server.metrics()
    hits = after["chunkserve:prefix_cache_hits_total{}"] - idle["chunkserve:prefix_cache_hits_total{}"]
    queries = after["chunkserve:prefix_cache_queries_total{}"] - idle["chunkserve:prefix_cache_queries_total{}"]
    assert hits == 96 + chat.usage.prompt_tokens_details.cached_tokens
    assert queries == 100 + 103 + chat.usage.prompt_tokens

    body = {"prompt": prompt, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with tiny_server.client() as http, tiny_server.admin_client() as admin:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()  # kept: dropping the iterator closes the stream
            next(line for line in lines if line.startswith("data: "))
            refused = admin.post("/reset_prefix_cache")
        assert refused.status_code == 409 and refused.json()["error"]["type"] == "conflict_error"
        tiny_server.wait_until(lambda m: m["chunkserve:num_requests_running{}"] == 0)
        assert admin.post("/reset_prefix_cache").status_code == 200
    again = client.completions.create(model=model_name, prompt=prompt, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("path, body, status, message, param", [
    ("/v1/completions", "{not json", 400, "malformed JSON", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens: Input should be a valid integer",
     "max_tokens"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt", "prompt"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 400, "model 'gpt-4' does not exist", "model"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt is empty", "prompt"),
    ("/v1/completions", {"prompt": "\x06"}, 400, "encodes to no tokens", "prompt"),
    ("/v1/completions", {"prompt": "hi " * 6000}, 400, r"prompt has \d+ tokens, but max_model_len is \d+", "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**6}, 400, r"exceeds max_model_len \(\d+", "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, r"max_tokens must be at least 1 \(0 only with echo",
     "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens: Input should be greater than or equal "
     "to 0", "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p: Input should be less than or equal to 1", "top_p"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature: Input should be greater than or equal "
     "to 0", "temperature"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, r"logprobs 50 is above the server's limit of 20 "
     r"\(--max-logprobs\)", "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 5000}, 400, "logprobs: Input should be less than or equal to 1024",
     "logprobs"),
    ("/v1/completions", {"prompt": "hi", "seed": 2**70}, 400, "seed: Input should be less than 18446744073709551616",
     "seed"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**9]}, 400, "stop_token_ids must be below",
     "stop_token_ids"),
    ("/v1/completions", {"prompt": [[]]}, 400, "prompt is empty", "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n: Input should be greater than or equal to 1", "n"),
    ("/v1/completions", {"prompt": "hi", "suffix": "!"}, 400, "suffix is not currently supported", "suffix"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages is empty", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "top_p": 0}, 400, "top_p", "top_p"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages.0.role",
     "messages"),
    ("/generate", {"sampling_params": {}}, 400, "exactly one of text and input_ids", "text"),
    ("/generate", {"input_ids": [10**9]}, 400, "out of range", "prompt"),
])
def test_bad_input_gets_400_with_an_openai_error_body(tiny_server, path, body, status, message, param):
    with tiny_server.client() as http:
        content = body if isinstance(body, str) else json.dumps(body)
        response = http.post(path, content=content)
        assert response.status_code == status
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["param"] == param and error["code"] == status and error["type"] == "invalid_request_error"
        assert re.search(message, error["message"]), error["message"]
        assert http.post("/v1/completions", json={"prompt": "ok", "max_tokens": 1}).status_code == 200


def test_the_openai_client_sees_bad_requests_as_bad_request_errors(client, model_name):
    with pytest.raises(openai.BadRequestError, match="top_p: Input should be less than or equal to 1"):
        client.completions.create(model=model_name, prompt="hi", top_p=2.0)


def test_oversized_body_gets_413(tiny_server):
    with tiny_server.client() as http:
        response = http.post("/v1/completions", json={"prompt": "x" * (MAX_BODY_BYTES + 1)})
    assert response.status_code == 413 and "larger than the limit" in response.json()["error"]["message"]


@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/generate"),
    ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/load"), ("POST", "/reset_prefix_cache"),
    ("GET", "/debug/check"),
])
def test_every_endpoint_but_the_polled_ones_needs_the_api_key(tiny_server, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        response = httpx.request(method, tiny_server.base_url + path, headers=headers, json={"prompt": "hi"})
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("method, path", [("GET", "/health"), ("GET", "/ping"), ("POST", "/ping"),
                                          ("GET", "/version"), ("GET", "/metrics")])
def test_what_load_balancers_and_prometheus_poll_is_open_as_in_vllm(tiny_server, method, path):
    assert httpx.request(method, tiny_server.base_url + path).status_code == 200


def test_models_version_and_health(tiny_server, model_name, tiny_gguf):
    with tiny_server.client() as http:
        models = http.get("/v1/models").json()
        assert models["object"] == "list" and models["data"][0]["max_model_len"] > 0
        assert model_name.startswith(os.path.basename(tiny_gguf).removesuffix(".gguf"))
        assert http.get("/version").json()["version"]
        assert http.get("/health").status_code == 200
        assert http.get("/no-such-route").json()["error"]["code"] == 404


def test_step_trace_file_and_debug_endpoint_agree(tiny_server, client, model_name):
    client.completions.create(model=model_name, prompt="Count to ten:", max_tokens=6, extra_body={"ignore_eos": True})
    tiny_server.wait_until(lambda m: m["chunkserve:num_requests_running{}"] == 0)
    with tiny_server.admin_client() as admin:
        steps = admin.get("/debug/steps", params={"last": 5}).json()["steps"]
        assert admin.get("/debug/steps", params={"last": "many"}).status_code == 400
    assert len(steps) == 5 and steps[-1]["forward_mode"] == "DECODE"
    assert set(steps[0]) == {"step_id", "start_time", "duration_s", "forward_mode", "num_prefill_tokens",
                             "num_decode_tokens", "num_requests", "num_preemptions", "kv_cache_usage",
                             "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate",
                             "predicted_duration_s", "prediction_error_p50", "prediction_error_p90",
                             "slo_margin", "prefill_wait_guard", "kv_transfer_bytes", "num_draft_tokens",
                             "num_accepted_tokens", "grammar_mask_s", "grammar_compile_s", "num_encoder_inputs",
                             "num_encoder_embeds", "encoder_cache_hits", "encoder_s", "request_ids",
                             "sampled_request_ids", "ranks", "deterministic", "shape", "prompt_chunks"}
    assert steps[-1]["ranks"] == [] and steps[-1]["request_ids"] == []  # one process, no pipeline
    assert 0 <= steps[-1]["prediction_error_p50"] <= steps[-1]["prediction_error_p90"]
    assert steps[-1]["slo_margin"] >= 1
    with open(tiny_server.trace_path) as f:
        traced = [json.loads(line) for line in f]
    assert traced[-5:] == steps
    assert [s["step_id"] for s in traced] == list(range(len(traced)))  # every step, in order
    total = tiny_server.metrics()
    steps_total = sum(total[f"chunkserve:engine_steps_total{{forward_mode={m}}}"] for m in ("EXTEND", "MIXED", "DECODE"))
    assert len(traced) == steps_total
    assert total["chunkserve:step_time_prediction_relative_error{quantile=0.9}"] == traced[-1]["prediction_error_p90"]

"""A vLLM user's launch command and client code, unchanged, against a real server on the tiny
model (SmolLM2's tokenizer and chat template, random weights): the model positional, several
served names, VLLM_API_KEY, CORS, /tokenize, /detokenize, /ping, /load, the periodic stats line,
a port in use refused before the model loads, and the chat-template fields (chat_template with
--trust-request-chat-template, chat_template_kwargs, continue_final_message) through the openai
client's extra_body. That a continued final message is continued sensibly ("Paris") needs real
weights: that one check runs on SmolLM2 (the session `server`).

The server runs with the test step delay, so a long generation is still running when the test
acts on it (an abort) and the stats logger fires while a request runs."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from chunkserve.engine.core import TEST_STEP_DELAY_ENV
from tests.server_process import Server, start_command, stop_server
from tests.tiny_model import STEP_DELAY_MS, TINY_SERVER_ENV

KEY = "vllm-style-key"


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory, tiny_gguf):
    command = [sys.executable, "-m", "chunkserve.entrypoints.cli", "serve", tiny_gguf,
               "--served-model-name", "gpt-4o-mini", "smollm", "--dtype", "float",
               "--max-model-len", "2k", "--gpu-memory-utilization", "0.9", "--enforce-eager", "--trust-remote-code",
               "--disable-log-requests", "--kv-cache-memory-bytes", "256M", "--trust-request-chat-template",
               "--allowed-origins", '["https://app.example"]', "--root-path", "/llm"]
    env = {**os.environ, **TINY_SERVER_ENV, "CHUNKSERVE_API_KEY": "", "VLLM_API_KEY": KEY,
           "CHUNKSERVE_LOG_STATS_INTERVAL": "0.5", TEST_STEP_DELAY_ENV: str(STEP_DELAY_MS)}
    server = start_command(tmp_path_factory, command, name="vllm_launch", env=env)  # (the harness adds --port)
    yield server
    stop_server(server)


def read_log(server: Server) -> str:
    with open(server.log_path) as log:
        return log.read()


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def test_the_openai_client_works_under_each_served_name_with_vllms_key_variable(vllm_server):
    client = openai.OpenAI(base_url=f"{vllm_server.base_url}/v1", api_key=KEY)
    assert [m.id for m in client.models.list().data] == ["gpt-4o-mini", "smollm"]
    for name in ("gpt-4o-mini", "smollm"):
        answer = client.completions.create(model=name, prompt="The capital of France is", max_tokens=4,
                                           temperature=0)
        assert answer.model == "gpt-4o-mini" and answer.choices[0].text
    with pytest.raises(openai.BadRequestError, match="'smollm'"):
        client.completions.create(model="other", prompt="hi", max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{vllm_server.base_url}/v1", api_key="wrong").models.list()


def test_tokenize_and_detokenize_round_trip(vllm_server):
    with httpx.Client(base_url=vllm_server.base_url, headers=auth()) as http:
        tokens = http.post("/tokenize", json={"model": "smollm", "prompt": "Hello world",
                                              "return_token_strs": True}).json()
        assert tokens["count"] == len(tokens["tokens"]) == len(tokens["token_strs"]) > 0
        assert tokens["max_model_len"] == 2000
        assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"].endswith("Hello world")
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
        assert chat["count"] > tokens["count"]  # the chat template's tokens
        bad = http.post("/detokenize", json={"tokens": [10**9]})
        assert bad.status_code == 400 and "out of range" in bad.json()["error"]["message"]


def test_ping_and_load_answer(vllm_server):
    assert httpx.get(f"{vllm_server.base_url}/ping").status_code == 200
    assert httpx.post(f"{vllm_server.base_url}/ping").status_code == 200
    load = httpx.get(f"{vllm_server.base_url}/load", headers=auth()).json()
    assert load == {"server_load": 0}


def test_cors_preflight_is_answered_for_allowed_origins_only(vllm_server):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    allowed = httpx.options(f"{vllm_server.base_url}/v1/completions",
                            headers={"Origin": "https://app.example", **preflight})
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.options(f"{vllm_server.base_url}/v1/completions", headers={"Origin": "https://evil.example",
                                                                             **preflight})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers


def test_root_path_is_where_the_docs_say_the_api_is(vllm_server):
    assert httpx.get(f"{vllm_server.base_url}/openapi.json", headers=auth()).json()["servers"] == [{"url": "/llm"}]


def test_the_stats_line_is_logged_while_requests_run(vllm_server):
    """48 steps of STEP_DELAY_MS (about 2 s) span several 0.5 s stats intervals; the line is
    written by a periodic task, so the log is polled for it."""
    client = openai.OpenAI(base_url=f"{vllm_server.base_url}/v1", api_key=KEY)
    client.completions.create(model="smollm", prompt="Count to twenty:", max_tokens=48, temperature=0,
                              extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 30  # the logger's 0.5 s interval, with room for a loaded host
    while not ("avg generation throughput:" in (log := read_log(vllm_server))
               and "KV cache usage:" in log and "prefix cache hit rate:" in log):
        assert time.monotonic() < deadline, f"no stats line in the log:\n{log[-4000:]}"
        time.sleep(0.1)


def test_a_port_in_use_fails_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "chunkserve.entrypoints.cli", "serve", "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "engine core ready" not in done.stderr


@pytest.mark.parametrize("field,value,message", [
    ("suffix", "!", "suffix is not currently supported"),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool calling"),
    ("guided_json", {"type": "object"}, "structured_outputs"),
    ("priority", 1, "--scheduling-policy priority"),
])
def test_fields_that_cannot_be_honoured_are_refused_by_name(vllm_server, field, value, message):
    response = httpx.post(f"{vllm_server.base_url}/v1/completions", headers=auth(),
                          json={"prompt": "hi", "max_tokens": 1, field: value})
    assert response.status_code == 400
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == field


def test_harmless_values_and_fields_vllm_ignores_are_accepted_and_change_nothing(vllm_server):
    """No tools, tool_choice "none", a text response_format and the bookkeeping fields: the
    same prompt and the same greedy answer as the bare request."""
    bare = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}
    harmless = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "user": "u-1",
                "store": False, "metadata": {"k": "v"}}
    answers = [httpx.post(f"{vllm_server.base_url}/v1/chat/completions", headers=auth(), json=body, timeout=60)
               for body in (bare, {**bare, **harmless})]
    assert [answer.status_code for answer in answers] == [200, 200], answers[1].text
    plain, with_fields = (answer.json() for answer in answers)
    assert with_fields["choices"][0]["message"] == plain["choices"][0]["message"]
    assert with_fields["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"] == "length"
    usage = ("prompt_tokens", "completion_tokens")  # (not cached_tokens: the second prompt hits the first's blocks)
    assert [with_fields["usage"][key] for key in usage] == [plain["usage"][key] for key in usage]


def test_an_unknown_field_is_logged_once_by_name(vllm_server):
    for _ in range(2):
        response = httpx.post(f"{vllm_server.base_url}/v1/completions", headers=auth(),
                              json={"prompt": "hi", "max_tokens": 1, "frobnicate_level": 3})
        assert response.status_code == 200
    log = open(vllm_server.log_path).read()
    assert log.count("'frobnicate_level' is not known to chunkserve and was ignored") == 1


def test_sglang_info_and_deep_health_endpoints(vllm_server, tiny_gguf):
    with httpx.Client(base_url=vllm_server.base_url, headers=auth(), timeout=60) as http:
        info = http.get("/get_model_info").json()
        assert info["is_generation"] is True and info["model_path"] == tiny_gguf
        server_info = http.get("/get_server_info").json()
        assert server_info["max_model_len"] == 2000 and server_info["served_model_name"] == ["gpt-4o-mini", "smollm"]
        assert "api_key" not in server_info and KEY not in json.dumps(server_info)
        assert server_info["dtype"] == "float32"  # vLLM's spelling --dtype float, resolved
        cache_config = [line for line in http.get("/metrics").text.splitlines()
                        if line.startswith("chunkserve:cache_config_info{")]
        assert cache_config and all('cache_dtype="float32"' in line for line in cache_config)
        threads = server_info["cpu_threads"]  # as the engine process runs them
        assert threads["threads"] == 1 and threads["pinned"] is False  # TINY_SERVER_ENV's OMP_NUM_THREADS, kept
        if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):  # else the user's choice stands
            assert threads["wait_policy"] == "GOMP_SPINCOUNT=1000"
        assert http.get("/health_generate").status_code == 200
        flush = http.post("/flush_cache")
        assert flush.status_code == 404 and "--admin-api-key" in flush.json()["error"]["message"]


def test_sglang_abort_request_ends_a_running_generation(vllm_server):
    """1,000 steps of STEP_DELAY_MS (40 s): the abort, sent after the first token, finds it running."""
    body = {"text": "Count to one thousand:", "rid": "to-abort", "stream": True,
            "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True, "temperature": 0}}
    with httpx.Client(base_url=vllm_server.base_url, headers=auth(), timeout=120) as http:
        with http.stream("POST", "/generate", json=body) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # it is generating
            assert http.post("/abort_request", json={"rid": "to-abort"}).status_code == 200
            events = [json.loads(line[5:]) for line in lines if line.startswith("data:") and "[DONE]" not in line]
    final = events[-1]["meta_info"]
    assert final["finish_reason"]["type"] == "abort" and final["completion_tokens"] < 1000


def prefix_cache_hits(server) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("chunkserve:prefix_cache_hits_total"))


def test_n_samples_share_the_prompts_blocks_and_seeded_samples_differ(vllm_server):
    client = openai.OpenAI(base_url=f"{vllm_server.base_url}/v1", api_key=KEY)
    prompt = "Write a story about a lighthouse keeper and a storm. " * 8  # ~96 tokens: 6 full blocks
    before = prefix_cache_hits(vllm_server)
    n_before = vllm_server.metrics()
    answer = client.completions.create(model="smollm", prompt=prompt, n=3, seed=11, max_tokens=12, temperature=1.0)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert len({c.text for c in answer.choices}) > 1  # seeds 11, 12, 13
    num_prompt = answer.usage.prompt_tokens
    assert prefix_cache_hits(vllm_server) - before >= 2 * ((num_prompt - 1) // 16 * 16)  # samples 1, 2 read its blocks
    # vLLM's per-parent histograms: one request of n = 3, its longest sample's length
    n_after = vllm_server.wait_until(lambda m: m["chunkserve:request_params_n_count{}"]
                                     == n_before["chunkserve:request_params_n_count{}"] + 1)
    assert n_after["chunkserve:request_params_n_sum{}"] - n_before["chunkserve:request_params_n_sum{}"] == 3
    longest = max(answer.choices, key=lambda c: c.finish_reason == "length")  # 12 tokens unless every one stopped
    assert (n_after["chunkserve:request_max_num_generation_tokens_count{}"]
            - n_before["chunkserve:request_max_num_generation_tokens_count{}"]) == 1
    if longest.finish_reason == "length":
        assert (n_after["chunkserve:request_max_num_generation_tokens_sum{}"]
                - n_before["chunkserve:request_max_num_generation_tokens_sum{}"]) == 12
    again = client.completions.create(model="smollm", prompt=prompt, n=3, seed=11, max_tokens=12, temperature=1.0)
    assert [c.text for c in again.choices] == [c.text for c in answer.choices]
    chat = client.chat.completions.create(model="smollm", messages=[{"role": "user", "content": "Hi"}], n=2,
                                          max_tokens=4, temperature=0, stream=True)
    indices = {chunk.choices[0].index for chunk in chat if chunk.choices}
    assert indices == {0, 1}


def test_vllm_sampling_extras_through_the_openai_client(vllm_server):
    client = openai.OpenAI(base_url=f"{vllm_server.base_url}/v1", api_key=KEY)
    prompt = "The capital of France is"

    def complete(logprobs=None, echo=False, **extra):
        return client.completions.create(model="smollm", prompt=prompt, max_tokens=6, temperature=0,
                                         logprobs=logprobs, echo=echo, extra_body=extra)

    plain = complete()
    greedy_ids = [int(t.split(":")[1]) for t in complete(logprobs=0, return_tokens_as_token_ids=True)
                  .choices[0].logprobs.tokens]
    allowed = complete(allowed_token_ids=greedy_ids[:1] + [28, 29], logprobs=0, return_tokens_as_token_ids=True)
    assert {int(t.split(":")[1]) for t in allowed.choices[0].logprobs.tokens} <= {greedy_ids[0], 28, 29}
    # bad_words bans a word's own tokens, and the word after a space where that is as many tokens
    # (vLLM's rule): the banned word is the greedy output's first word that is one token either way,
    # and no token of either form may appear. (A random model spells longer words in tokens the
    # tokenizer would not choose, which no bad word matches.)
    with httpx.Client(base_url=vllm_server.base_url, headers=auth()) as http:
        def tokens_of(text: str) -> list[int]:
            return http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]

        words = [http.post("/detokenize", json={"tokens": [token]}).json()["prompt"].strip() for token in greedy_ids]
        position, word = next((i, w) for i, w in enumerate(words)
                              if w and len(tokens_of(w)) == len(tokens_of(" " + w)) == 1)
        forms = {*tokens_of(word), *tokens_of(" " + word)}
    assert greedy_ids[position] in forms
    banned = complete(bad_words=[word], logprobs=0, return_tokens_as_token_ids=True)
    banned_ids = [int(t.split(":")[1]) for t in banned.choices[0].logprobs.tokens]
    assert not forms & set(banned_ids) and banned_ids[:position] == greedy_ids[:position], (word, banned_ids)
    assert banned.choices[0].text != plain.choices[0].text
    stop = plain.choices[0].text.strip()[:3]
    kept = client.completions.create(model="smollm", prompt=prompt, max_tokens=6, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text.endswith(stop)
    echoed = complete(echo=True, logprobs=1)
    records = echoed.choices[0].logprobs
    assert echoed.choices[0].text.startswith(prompt) and records.token_logprobs[0] is None
    assert len(records.tokens) == echoed.usage.prompt_tokens + echoed.usage.completion_tokens
    with_prompt = httpx.post(f"{vllm_server.base_url}/v1/completions", headers=auth(), json={
        "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2}).json()["choices"][0]["prompt_logprobs"]
    assert with_prompt[0] is None and all(len(entry) >= 2 for entry in with_prompt[1:])
    short = complete(truncate_prompt_tokens=3)
    assert short.usage.prompt_tokens == 3


PREFILLED = [{"role": "user", "content": "What is the capital of France?"},
             {"role": "assistant", "content": "The capital of France is"}]
THINKING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not "
                     "enable_thinking %}/no_think\n{% endif %}{% endif %}")


def chat_prompt_tokens(vllm_server, messages, **fields) -> tuple[int, list[int]]:
    """The chat's prompt size as the server counts it (usage), and /tokenize's ids for the same fields."""
    client = openai.OpenAI(base_url=f"{vllm_server.base_url}/v1", api_key=KEY)
    answer = client.chat.completions.create(model="smollm", messages=messages, max_tokens=1, temperature=0,
                                            extra_body=fields)
    with httpx.Client(base_url=vllm_server.base_url, headers=auth()) as http:
        tokens = http.post("/tokenize", json={"messages": messages, **fields}).json()["tokens"]
    return answer.usage.prompt_tokens, tokens


def test_continue_final_message_continues_the_assistants_text(vllm_server):
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    count, tokens = chat_prompt_tokens(vllm_server, PREFILLED, **fields)
    assert count == len(tokens)
    with httpx.Client(base_url=vllm_server.base_url, headers=auth()) as http:
        text = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nThe capital of France is")  # open: no end of turn
    client = openai.OpenAI(base_url=f"{vllm_server.base_url}/v1", api_key=KEY)
    answer = client.chat.completions.create(model="smollm", messages=PREFILLED, max_tokens=4, temperature=0,
                                            extra_body=fields)
    same = client.completions.create(model="smollm", prompt=tokens, max_tokens=4, temperature=0)
    assert answer.choices[0].message.content == same.choices[0].text
    with pytest.raises(openai.BadRequestError, match="Cannot set both `continue_final_message` and "
                                                     "`add_generation_prompt` to True"):
        client.chat.completions.create(model="smollm", messages=PREFILLED, max_tokens=1,
                                       extra_body={"continue_final_message": True})


def test_continue_final_message_is_continued_sensibly_on_real_weights(server):
    """SmolLM2 (the session server) finishes the assistant's open sentence: the continuation
    is of the prefilled text, not a new turn."""
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    with server.client() as http:
        tokens = http.post("/tokenize", json={"messages": PREFILLED, **fields}).json()["tokens"]
        answer = http.post("/v1/chat/completions", json={"messages": PREFILLED, "max_tokens": 4, "temperature": 0,
                                                         **fields})
        same = http.post("/v1/completions", json={"prompt": tokens, "max_tokens": 4, "temperature": 0})
    assert answer.status_code == same.status_code == 200, (answer.text, same.text)
    text = same.json()["choices"][0]["text"]
    assert answer.json()["choices"][0]["message"]["content"] == text and "Paris" in text


def test_a_request_chat_template_and_its_kwargs_shape_the_prompt(vllm_server):
    messages = PREFILLED[:1]
    plain, plain_tokens = chat_prompt_tokens(vllm_server, messages, chat_template=THINKING_TEMPLATE)
    off, off_tokens = chat_prompt_tokens(vllm_server, messages, chat_template=THINKING_TEMPLATE,
                                         chat_template_kwargs={"enable_thinking": False})
    assert (plain, off) == (len(plain_tokens), len(off_tokens)) and off > plain
    with httpx.Client(base_url=vllm_server.base_url, headers=auth()) as http:
        assert http.post("/detokenize", json={"tokens": off_tokens}).json()["prompt"].endswith("/no_think\n")
    default, _ = chat_prompt_tokens(vllm_server, messages)
    assert default != plain  # the model's template has a system prompt; the request's has none
    client = openai.OpenAI(base_url=f"{vllm_server.base_url}/v1", api_key=KEY)
    with pytest.raises(openai.BadRequestError, match="chat_template failed"):
        client.chat.completions.create(model="smollm", messages=messages, max_tokens=1,
                                       extra_body={"chat_template": "{% if %}"})


def test_use_beam_search_through_the_openai_client(vllm_server):
    """vLLM's use_beam_search: n beams, best first, answered whole; width 1 is greedy."""
    client = openai.OpenAI(base_url=f"{vllm_server.base_url}/v1", api_key=KEY)
    prompt = "The capital of France is"

    def complete(n=1, stream=False, **extra):
        return client.completions.create(model="smollm", prompt=prompt, max_tokens=5, n=n, temperature=0, logprobs=1,
                                         stream=stream, extra_body={"ignore_eos": True, **extra})

    greedy = complete()
    assert complete(use_beam_search=True, length_penalty=0.0).choices[0].text == greedy.choices[0].text
    answer = complete(3, use_beam_search=True, length_penalty=0.0)
    assert [c.index for c in answer.choices] == [0, 1, 2] and len({c.text for c in answer.choices}) == 3
    cumulative = [sum(c.logprobs.token_logprobs) for c in answer.choices]
    assert cumulative == sorted(cumulative, reverse=True)  # best first: by cumulative logprob at length_penalty 0
    assert cumulative[0] >= sum(greedy.choices[0].logprobs.token_logprobs) - 1e-4
    assert all(c.finish_reason == "length" for c in answer.choices) and answer.usage.completion_tokens == 15
    assert answer.usage.prompt_tokens == greedy.usage.prompt_tokens
    chat = client.chat.completions.create(model="smollm", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          n=2, temperature=0, extra_body={"use_beam_search": True})
    assert [c.index for c in chat.choices] == [0, 1] and all(c.message.content for c in chat.choices)
    with pytest.raises(openai.BadRequestError, match="use_beam_search does not stream"):
        complete(2, stream=True, use_beam_search=True)

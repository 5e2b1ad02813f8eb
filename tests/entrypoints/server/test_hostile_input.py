"""The hostile requests that once failed bystanders or stalled the server, as regression tests
against the real server on the tiny model: each gets a clear 400 (or is served harmlessly) while
a bystander's stream runs beside it and finishes untouched.

The server sleeps STEP_DELAY_MS before each step, so the bystander (and the hung-up batch) are
still decoding while the test acts; the tests assert that they were."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from tests.server_process import API_KEY

# 100 steps of at least STEP_DELAY_MS each: 4 s, far longer than the hostile requests take on the tiny model.
BYSTANDER = {"prompt": "Tell me a story about a lighthouse.", "max_tokens": 100, "ignore_eos": True,
             "temperature": 0.8, "seed": 7, "stream": True}


@pytest.fixture(scope="module")
def server(tiny_delayed_server):
    """The tiny model's server, each step delayed so that streams outlast the test's actions."""
    return tiny_delayed_server


def raw_post(server, path: str, body: str | dict, **kwargs) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    with server.client() as http:
        return http.post(path, content=content, **kwargs)


def stream_text(server, body: dict, on_event: Callable[[dict], None] = lambda event: None) -> tuple[str, list[str]]:
    """A streamed completion's text and the finish reasons of its events; `on_event` sees each event."""
    text, reasons = "", []
    with server.client() as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                text += event["choices"][0]["text"]
                reasons.append(event["choices"][0]["finish_reason"])
                on_event(event)
    return text, reasons


@pytest.fixture(scope="module")
def bystander_text(server) -> str:
    """The bystander's text with nothing hostile beside it (seeded: the same every run)."""
    return stream_text(server, BYSTANDER)[0]


HOSTILE = [  # (name, path, raw JSON body, the field the 400 must name)
    ("nan_temperature", "/v1/completions", '{"prompt": "hi", "temperature": NaN}', "temperature"),
    ("infinite_temperature", "/v1/completions", '{"prompt": "hi", "temperature": Infinity}', "temperature"),
    ("overflowing_temperature", "/v1/completions", '{"prompt": "hi", "temperature": 1e400}', "temperature"),
    ("nan_repetition_penalty", "/v1/completions", '{"prompt": "hi", "repetition_penalty": NaN}',
     "repetition_penalty"),
    ("tiny_repetition_penalty", "/v1/completions", '{"prompt": "hi", "repetition_penalty": 1e-45}',
     "repetition_penalty"),
    ("chat_nan_top_p", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "top_p": NaN}',
     "top_p"),
    ("generate_nan_temperature", "/generate", '{"text": "hi", "sampling_params": {"temperature": NaN}}',
     "sampling_params"),
    ("bool_token_ids", "/v1/completions", '{"prompt": [true, false]}', "prompt"),
    ("float_token_ids", "/v1/completions", '{"prompt": [1.0, 2.0]}', "prompt"),
    ("string_max_tokens", "/v1/completions", '{"prompt": "hi", "max_tokens": "4"}', "max_tokens"),
    ("top_logprobs_named_right", "/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 50}', "top_logprobs"),
    ("max_completion_tokens_named_right", "/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}', "max_completion_tokens"),
    ("too_many_prompts", "/v1/completions", json.dumps({"prompt": ["hi"] * 257, "max_tokens": 1}), "prompt"),
    ("too_many_stop_token_ids", "/v1/completions", json.dumps({"prompt": "hi", "stop_token_ids": [5] * 2000}),
     "stop_token_ids"),
    ("too_many_stop_strings", "/v1/completions", json.dumps({"prompt": "hi", "stop": ["x"] * 65}), "stop"),
    ("overlong_stop_string", "/v1/completions", json.dumps({"prompt": "hi", "stop": ["x" * 2000]}), "stop"),
    ("prompt_over_the_character_limit", "/v1/completions", json.dumps({"prompt": "word " * 40_000}), "prompt"),
    ("chat_over_the_character_limit", "/v1/chat/completions",
     json.dumps({"messages": [{"role": "user", "content": "word " * 40_000}]}), "messages"),
    ("ten_thousand_empty_messages", "/v1/chat/completions", json.dumps({"messages": [{"role": "user"}] * 10_000}),
     "messages"),
    ("empty_cache_salt", "/v1/completions", '{"prompt": "hi", "cache_salt": ""}', "cache_salt"),
    ("too_many_logit_bias_entries", "/v1/completions",
     json.dumps({"prompt": "hi", "logit_bias": {str(i): 1.0 for i in range(1025)}}), "logit_bias"),
    ("logit_bias_key_not_a_token_id", "/v1/completions", '{"prompt": "hi", "logit_bias": {"abc": 1}}', "logit_bias"),
    ("logit_bias_key_outside_the_vocabulary", "/v1/completions", '{"prompt": "hi", "logit_bias": {"99999999": 1}}',
     "logit_bias"),
    ("logit_bias_out_of_range", "/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 1000}}', "logit_bias"),
]


def test_hostile_requests_get_400_naming_the_field_and_a_bystander_is_untouched(server, bystander_text):
    result: dict = {}
    streaming, finished = threading.Event(), threading.Event()

    def on_event(event: dict) -> None:
        streaming.set()
        if event["choices"][0]["finish_reason"] is not None:
            finished.set()

    bystander = threading.Thread(target=lambda: result.update(text=stream_text(server, BYSTANDER, on_event)))
    bystander.start()
    assert streaming.wait(60), "the bystander never streamed"
    failures = []
    for name, path, body, param in HOSTILE:
        started = time.monotonic()
        response = raw_post(server, path, body)
        error = response.json().get("error", {})
        if response.status_code != 400 or error.get("param") != param or time.monotonic() - started > 5:
            failures.append((name, response.status_code, error))
    ran_beside_every_hostile_request = not finished.is_set()
    bystander.join(120)
    assert not failures, failures
    assert ran_beside_every_hostile_request, "the bystander finished before the hostile requests did"
    text, reasons = result["text"]
    assert text == bystander_text and reasons[-1] == "length"


def test_logit_bias_forces_a_token(server):
    def tokens(bias: dict | None) -> list[str]:
        body = {"prompt": [1200, 1300], "max_tokens": 4, "temperature": 0, "ignore_eos": True, "logprobs": 0,
                **({"logit_bias": bias} if bias else {})}
        response = raw_post(server, "/v1/completions", body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["logprobs"]["tokens"]

    forced = tokens({"1234": 100})
    assert len(forced) == 4 and len(set(forced)) == 1
    assert tokens(None) != forced  # the bias, not the model, chose them


def test_a_streamed_generate_reports_its_whole_length(server):
    with server.client() as http:
        body = {"text": "Once upon a time", "stream": True, "sampling_params": {
            "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}}
        events = [json.loads(line[6:]) for line in http.post("/generate", json=body).text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert len(events[-1]["output_ids"]) == 5 and events[-1]["meta_info"]["completion_tokens"] == 5


def test_a_top_k_beyond_the_vocabulary_means_no_top_k(server):
    def sampled_text(**top_k) -> str:
        response = raw_post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 8, "temperature": 1.0,
                                                        "seed": 1, **top_k})
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8
        return response.json()["choices"][0]["text"]

    untruncated = sampled_text()
    assert sampled_text(top_k=1) != untruncated  # this seed's sample is not the greedy text: top_k shows
    for top_k in (2**63, 10**6):
        assert sampled_text(top_k=top_k) == untruncated


def test_a_client_that_hangs_up_stops_the_work_of_every_prompt_it_sent(server):
    aborted_key = "chunkserve:request_success_total{finished_reason=abort}"
    aborted_before = server.metrics()[aborted_key]
    body = {"prompt": [f"Story number {i}:" for i in range(40)], "max_tokens": 2000, "ignore_eos": True}
    with server.client() as http, pytest.raises(httpx.ReadTimeout):
        # 2000 steps of at least STEP_DELAY_MS take over a minute: the client gives up while they decode.
        http.post("/v1/completions", json=body, timeout=1.5)  # its connection closes
    drained = server.wait_until(lambda m: m["chunkserve:num_requests_running{}"] == 0
                                and m["chunkserve:num_requests_waiting{}"] == 0, timeout_s=20)
    assert drained[aborted_key] == aborted_before + 40  # stopped, not finished


def test_the_bearer_scheme_is_case_insensitive_and_openapi_shows_the_bodies(server):
    for scheme in ("bearer", "BEARER"):
        response = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"})
        assert response.status_code == 200
    with server.client() as http:
        spec = http.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/generate"):
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.split("/")[-1] in spec["components"]["schemas"]


def test_the_engine_checks_itself_and_admin_endpoints_need_the_admin_key(server):
    server.wait_until(lambda m: m["chunkserve:num_requests_running{}"] == 0)
    report = server.check()
    assert report["ok"], report
    assert report["num_free_blocks"] == report["num_blocks"] and report["num_requests"] == 0
    with server.client() as http:
        assert http.get("/debug/check").status_code == 401  # the API key is not the admin key

"""SGLang's /generate as an SGLang client uses it, against a real server on a tiny model:
batches of text or token ids (a list of results, one per prompt in order; streamed, one event
per result with its `index`), n samples per prompt (n * prompts results, prompt by prompt,
the prompt computed once), SGLang's logprob fields in meta_info (equal to /v1/completions'),
its sampling_params extras, and its fields chunkserve cannot honour refused by name."""

from __future__ import annotations

import json

import pytest

from tests.hostile_server import check_engine_clean, sse_events, start_tiny_server
from tests.server_process import stop_server

MAX_PROMPTS = 8
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
GREEDY = {"max_new_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = start_tiny_server(tmp_path_factory, "--max-prompts-per-request", str(MAX_PROMPTS),
                                "--max-num-batched-tokens", "64", name="sglang-generate", max_model_len=256)
    yield started
    stop_server(started)


@pytest.fixture(scope="module")
def http(server):
    with server.client() as client:
        yield client


def generate(http, **body) -> dict | list:
    response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(http, **body) -> list[str]:
    with http.stream("POST", "/generate", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        return sse_events(response.read().decode())


def test_a_batch_answers_a_list_of_the_single_prompt_answers_in_order(http):
    singles = [generate(http, text=p, sampling_params=GREEDY) for p in PROMPTS]
    assert all(isinstance(s, dict) for s in singles)  # one prompt: one object, as before
    batch = generate(http, text=PROMPTS, sampling_params=GREEDY, rid="job")
    assert isinstance(batch, list) and len(batch) == len(PROMPTS)
    assert [r["text"] for r in batch] == [s["text"] for s in singles]
    assert [r["output_ids"] for r in batch] == [s["output_ids"] for s in singles]
    assert [r["meta_info"]["id"] for r in batch] == ["job_0", "job_1", "job_2"]  # SGLang's rid expansion
    by_ids = generate(http, input_ids=[[1, 2, 3], [4, 5]], sampling_params=[GREEDY, {**GREEDY, "max_new_tokens": 3}],
                      rid=["a", "b"])
    assert [r["meta_info"]["id"] for r in by_ids] == ["a", "b"]
    assert [r["meta_info"]["prompt_tokens"] for r in by_ids] == [3, 2]
    assert [len(r["output_ids"]) for r in by_ids] == [6, 3]
    one_ids = generate(http, input_ids=[1, 2, 3], sampling_params=GREEDY)
    assert isinstance(one_ids, dict) and one_ids["output_ids"] == by_ids[0]["output_ids"]
    assert generate(http, text=PROMPTS[:1], sampling_params=GREEDY)[0]["text"] == singles[0]["text"]


def test_n_samples_per_prompt_come_prompt_by_prompt_and_share_the_prompt(http, server):
    prompt = "Write a story about a lighthouse keeper and a storm. " * 6  # ~70 tokens: 4 full blocks
    sampled = {"max_new_tokens": 8, "temperature": 1.0, "n": 3, "sampling_seed": 7}
    hits = "chunkserve:prefix_cache_hits_total{}"
    before = server.metrics()[hits]
    results = generate(http, text=prompt, sampling_params=sampled)
    assert isinstance(results, list) and len(results) == 3
    assert len({tuple(r["output_ids"]) for r in results}) > 1  # seeds 7, 8, 9
    full_blocks = (results[0]["meta_info"]["prompt_tokens"] - 1) // 16 * 16
    assert full_blocks >= 48
    assert server.metrics()[hits] - before >= 2 * full_blocks  # samples 1 and 2 read sample 0's blocks
    again = generate(http, text=prompt, sampling_params=sampled)
    assert [r["output_ids"] for r in again] == [r["output_ids"] for r in results]
    batch = generate(http, text=[prompt, "Hello"], sampling_params={**sampled, "n": 2})
    assert len(batch) == 4
    assert [r["meta_info"]["prompt_tokens"] for r in batch[:2]] == [results[0]["meta_info"]["prompt_tokens"]] * 2
    assert batch[0]["output_ids"] == results[0]["output_ids"]  # prompt-major: prompt 0's samples first
    assert batch[2]["meta_info"]["prompt_tokens"] == batch[3]["meta_info"]["prompt_tokens"] < 10


def test_output_logprobs_equal_the_completions_endpoints(http):
    prompt, k = PROMPTS[0], 3
    result = generate(http, text=prompt, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=k,
                      return_text_in_logprobs=True)
    meta = result["meta_info"]
    completion = http.post("/v1/completions", json={
        "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": k, "return_tokens_as_token_ids": True,
        "prompt_logprobs": 1}).json()["choices"][0]
    expected = completion["logprobs"]
    assert [entry[1] for entry in meta["output_token_logprobs"]] == result["output_ids"] == [
        int(token.split(":")[1]) for token in expected["tokens"]]
    assert [entry[0] for entry in meta["output_token_logprobs"]] == pytest.approx(expected["token_logprobs"],
                                                                                 abs=1e-5)
    assert all(isinstance(entry[2], str) for entry in meta["output_token_logprobs"])  # return_text_in_logprobs
    assert len(meta["output_top_logprobs"]) == len(result["output_ids"])
    for top, wanted in zip(meta["output_top_logprobs"], expected["top_logprobs"]):
        values = [entry[0] for entry in top]
        assert len(top) == k and values == sorted(values, reverse=True)
        assert values == pytest.approx(sorted(wanted.values(), reverse=True), abs=1e-5)
    # by default (logprob_start_len -1) the prompt's last token only, its logprob None as in SGLang
    prompt_ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert meta["input_token_logprobs"] == [[None, prompt_ids[-1], meta["input_token_logprobs"][0][2]]]
    assert meta["input_top_logprobs"] == [None]
    # from the prompt's start: every prompt token, the first None
    full = generate(http, text=prompt, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)["meta_info"]
    assert [entry[1] for entry in full["input_token_logprobs"]] == prompt_ids
    assert full["input_token_logprobs"][0][0] is None and all(e[2] is None for e in full["input_token_logprobs"])
    vllm_prompt = completion["prompt_logprobs"]
    assert [e[0] for e in full["input_token_logprobs"][1:]] == pytest.approx(
        [vllm_prompt[i][str(t)]["logprob"] for i, t in enumerate(prompt_ids) if i > 0], abs=1e-5)
    assert "input_top_logprobs" not in full and "output_top_logprobs" not in full  # top_logprobs_num 0
    plain = generate(http, text=prompt, sampling_params=GREEDY)["meta_info"]
    assert "output_token_logprobs" not in plain and "input_token_logprobs" not in plain
    past_end = http.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": GREEDY,
                                            "return_logprob": True, "logprob_start_len": 3})
    assert past_end.status_code == 400 and past_end.json()["error"]["param"] == "logprob_start_len"


def test_a_streamed_batch_sends_every_index_then_done(http):
    body = {"text": PROMPTS[:2], "sampling_params": {**GREEDY, "n": 2}, "return_logprob": True}
    events = streamed(http, **body)
    assert events[-1] == "[DONE]"
    results = [json.loads(event) for event in events[:-1]]
    assert {r["index"] for r in results} == {0, 1, 2, 3}
    last = {r["index"]: r for r in results}  # each event carries the whole text so far
    plain = generate(http, **body)
    for index, expected in enumerate(plain):
        assert last[index]["text"] == expected["text"] and last[index]["output_ids"] == expected["output_ids"]
        assert last[index]["meta_info"]["finish_reason"] == expected["meta_info"]["finish_reason"]
        shown, wanted = last[index]["meta_info"], expected["meta_info"]
        assert [e[1] for e in shown["output_token_logprobs"]] == [e[1] for e in wanted["output_token_logprobs"]]
        assert [e[0] for e in shown["output_token_logprobs"]] == pytest.approx(
            [e[0] for e in wanted["output_token_logprobs"]], abs=1e-5)
    single = [json.loads(e) for e in streamed(http, text=PROMPTS[0], sampling_params=GREEDY)[:-1]]
    assert "index" not in single[-1] and single[-1]["text"] == plain[0]["text"]


def test_sampling_params_extras(http):
    base = generate(http, text=PROMPTS[1], sampling_params={**GREEDY, "max_new_tokens": 12})
    stop = base["text"][3:6]
    trimmed = generate(http, text=PROMPTS[1], sampling_params={**GREEDY, "max_new_tokens": 12, "stop": stop})
    kept = generate(http, text=PROMPTS[1], sampling_params={**GREEDY, "max_new_tokens": 12, "stop": stop,
                                                             "no_stop_trim": True})
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert kept["text"] == trimmed["text"] + stop
    biased = generate(http, text=PROMPTS[1], sampling_params={**GREEDY, "logit_bias": {"42": 100.0},
                                                               "spaces_between_special_tokens": False})
    assert biased["output_ids"][0] == 42


@pytest.mark.parametrize("body,param", [
    ({"image_data": "cat.png"}, "image_data"),
    ({"lora_path": "adapter"}, "lora_path"),
    ({"return_hidden_states": True}, "return_hidden_states"),
    ({"custom_logit_processor": "{}"}, "custom_logit_processor"),
    ({"token_ids_logprob": [1, 2]}, "token_ids_logprob"),
    ({"sampling_params": {**GREEDY, "json_schema": "{not json"}}, "json_schema"),
    ({"sampling_params": {**GREEDY, "stop_regex": "a+"}}, "stop_regex"),
    ({"text": ["x"] * (MAX_PROMPTS + 1)}, "text"),
    ({"input_ids": [[1], [2]], "sampling_params": {**GREEDY, "n": MAX_PROMPTS // 2 + 1}}, "input_ids"),
    ({"text": ["a", "b"], "rid": ["only-one"]}, "rid"),
    ({"text": ["a", "b"], "sampling_params": [GREEDY, {**GREEDY, "n": 2}]}, "sampling_params"),
    ({"return_logprob": True, "top_logprobs_num": 50}, "top_logprobs_num"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(http, server, body, param):
    base = {"sampling_params": GREEDY, "return_hidden_states": False}  # a value asking for nothing is accepted
    response = http.post("/generate", json={**base, **({} if "input_ids" in body else {"text": "hi"}), **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert param in error["message"] and "--max-top_logprobs_num" not in error["message"]
    check_engine_clean(server)

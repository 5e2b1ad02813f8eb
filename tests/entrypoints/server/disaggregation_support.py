"""What the prefill/decode tests share with the routers that pair the halves (chunkserve router,
SMG): prompts, the comparison with a monolithic server, and the equality cases every router must
pass (tests/entrypoints/server/test_disaggregation.py, tests/entrypoints/fleet/test_smg.py)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import httpx

from tests.server_process import API_KEY, Server

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
VOCAB_LOW, VOCAB_HIGH = 100, 40000
LENGTHS = [1, 15, 16, 17, 255, 256, 257, 2047]  # prompts around the block (16) and budget (64, 256) edges


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(length)]


def completion(response: httpx.Response) -> tuple[str, list[str], list[float], str]:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    logprobs = choice["logprobs"]
    return choice["text"], logprobs["tokens"], logprobs["token_logprobs"], choice["finish_reason"]


def assert_same(mono: httpx.Response, pd: httpx.Response, logprob_tolerance: float = 1e-5) -> None:
    """The same text, tokens and finish reason; logprobs within `logprob_tolerance` (1e-5: the
    same KV sent over, summed in the same order)."""
    text, tokens, logprobs, reason = completion(mono)
    pd_text, pd_tokens, pd_logprobs, pd_reason = completion(pd)
    assert (pd_text, pd_tokens, pd_reason) == (text, tokens, reason)
    assert max(abs(a - b) for a, b in zip(logprobs, pd_logprobs)) < logprob_tolerance


def idle(*servers: Server, timeout_s: float = 30.0) -> None:
    """Every server back to no request and every block free (cached blocks count as free): its
    /metrics and its self-check agree."""
    deadline = time.monotonic() + timeout_s
    for server in servers:
        while True:
            report, metrics = server.check(), server.metrics()
            gauges = [metrics[f"chunkserve:{name}{{}}"] for name in ("num_requests_running", "num_requests_waiting",
                                                                      "kv_cache_free_blocks", "kv_cache_total_blocks")]
            if report["ok"] and gauges[:2] == [0, 0] and gauges[2] == gauges[3]:
                break
            assert time.monotonic() < deadline, f"{server.base_url} never went idle: {report}"
            time.sleep(0.1)


def text_of(server: Server, token_ids: list[int]) -> str:
    """`token_ids` as text (the server's /detokenize), for routers that take only text prompts."""
    answer = httpx.post(server.base_url + "/detokenize", json={"tokens": token_ids}, headers=HEADERS, timeout=60)
    return answer.json()["prompt"]


def assert_outputs_equal_the_monolithic_server(mono: Server, post: Callable[[str, dict], httpx.Response],
                                               text_prompts: bool = False) -> None:
    """Greedy and seeded sampling through a router (`post(path, body)`) give the monolithic
    server's tokens, text and finish reason, logprobs within 1e-5, for prompts around block and
    budget edges; chat and SGLang's /generate too. `text_prompts`: the completions' prompts are
    those token ids as text (their lengths then only near the edges), for a router that refuses
    token-id prompts."""
    for length in LENGTHS:
        for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 1234 + length}):
            prompt = prompt_of(length, length)
            body = {"prompt": text_of(mono, prompt) if text_prompts else prompt, "max_tokens": 8, "logprobs": 2,
                    **sampling}
            direct = httpx.post(mono.base_url + "/v1/completions", json=body, headers=HEADERS, timeout=180)
            assert_same(direct, post("/v1/completions", body))
    chat = {"messages": [{"role": "user", "content": "Name three rivers of Europe."}], "max_tokens": 24,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}
    direct = httpx.post(mono.base_url + "/v1/chat/completions", json=chat, headers=HEADERS, timeout=180).json()
    routed = post("/v1/chat/completions", chat).json()
    assert routed["choices"][0]["message"] == direct["choices"][0]["message"]
    assert [t["token"] for t in routed["choices"][0]["logprobs"]["content"]] == [
        t["token"] for t in direct["choices"][0]["logprobs"]["content"]]
    generate = {"input_ids": prompt_of(40, 7), "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    direct = httpx.post(mono.base_url + "/generate", json=generate, headers=HEADERS, timeout=180).json()
    assert post("/generate", generate).json()["output_ids"] == direct["output_ids"]

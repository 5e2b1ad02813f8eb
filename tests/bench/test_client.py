"""The streaming client's reading of SSE events, on canned streams from a mock transport."""

from __future__ import annotations

import asyncio
import json

import httpx

from chunkserve.bench.client import completion_body, send_request
from chunkserve.bench.workloads import RequestSpec


def sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def token(text: str, finish_reason: str | None = None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish_reason}]}


def run(body: bytes, output_len: int = 3, status: int = 200):
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))

    async def go():
        async with httpx.AsyncClient(transport=transport) as client:
            return await send_request(client, "http://server", "m", RequestSpec([1, 2, 3], output_len, 0.0, "normal"))

    return asyncio.run(go())


def test_one_token_time_per_token_event_and_the_usage_count_wins():
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}
    result = run(sse(token("a"), token(""), token("c", "length"), usage, "[DONE]"))
    assert result.ok and len(result.token_times) == 3 and result.completion_tokens == 3


def test_a_closing_event_without_a_token_is_not_counted():
    """llama.cpp's server ends with an empty-text event carrying the finish reason."""
    result = run(sse(token("a"), token("b"), token("c"), token("", "length"), "[DONE]"))
    assert result.ok and len(result.token_times) == 3


def test_an_empty_token_before_the_last_one_is_still_a_token():
    result = run(sse(token("a"), token("", "length"), "[DONE]"), output_len=3)
    assert len(result.token_times) == 2


def test_errors_are_recorded():
    assert run(b"nope", status=500).error == "HTTP 500: nope"
    assert run(sse(token("a"))).error == "the stream ended without [DONE]"
    failed = run(sse(token("a"), {"error": {"message": "engine died"}}))
    assert not failed.ok and "engine died" in failed.error


def test_the_usage_event_reports_cached_prompt_tokens():
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1,
                                      "prompt_tokens_details": {"cached_tokens": 2}}}
    assert run(sse(token("a", "length"), usage, "[DONE]"), output_len=1).cached_tokens == 2
    assert run(sse(token("a", "length"), "[DONE]"), output_len=1).cached_tokens is None


def test_a_spec_with_text_sends_the_text_and_one_without_sends_its_token_ids():
    assert completion_body("m", RequestSpec([1, 2, 3], 4, 0.0, "turn"))["prompt"] == [1, 2, 3]
    assert completion_body("m", RequestSpec([1, 2, 3], 4, 0.0, "turn", prompt_text=" a b c"))["prompt"] == " a b c"

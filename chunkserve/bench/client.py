"""Streaming requests to any OpenAI-compatible /v1/completions, timed per token.

Every time is ``time.time()`` (wall clock), not a monotonic clock, so that the token times line
up with a server's step trace, which records ``time.time()`` too.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import httpx

from chunkserve.bench.workloads import RequestSpec

ERROR_TEXT_LIMIT = 500


@dataclass
class RequestResult:
    """What one request did, as seen by the client."""

    kind: str
    prompt_len: int
    output_len: int
    send_time: float
    token_times: list[float] = field(default_factory=list)
    end_time: float = 0.0
    ok: bool = False
    error: str | None = None
    completion_tokens: int = 0
    cached_tokens: int | None = None  # prompt tokens the server read from its prefix cache, if it says

    def to_dict(self) -> dict:
        return asdict(self)


def make_client(max_connections: int, api_key: str | None) -> httpx.AsyncClient:
    """One client for the whole run, with room for every request to be in flight at once."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return httpx.AsyncClient(timeout=None, limits=limits, headers=headers)


async def fetch_model_name(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model the server lists, for when --model is not given."""
    response = await client.get(f"{base_url}/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def server_tokenizer(base_url: str, model: str | None, api_key: str | None) -> Callable[[str], list[int]]:
    """The server's own tokenizer, through its /tokenize (vLLM's form, which chunkserve serves
    too): a data set's text is counted in the tokens the server will see, with no tokenizer here."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    client = httpx.Client(timeout=60.0, headers=headers)
    if model is None:
        response = client.get(f"{base_url}/v1/models")
        response.raise_for_status()
        model = response.json()["data"][0]["id"]

    def tokenize(text: str) -> list[int]:
        response = client.post(f"{base_url}/tokenize", json={"model": model, "prompt": text})
        if response.status_code != 200:
            raise RuntimeError(f"{base_url}/tokenize answered HTTP {response.status_code}: "
                             f"{response.text[:ERROR_TEXT_LIMIT]}")
        return response.json()["tokens"]

    return tokenize


def completion_body(model: str, spec: RequestSpec) -> dict:
    """Exactly ``output_len`` tokens (no early EOS), greedy, streamed one event per token."""
    return {
        "model": model, "prompt": spec.prompt_token_ids if spec.prompt_text is None else spec.prompt_text,
        "max_tokens": spec.output_len,
        "min_tokens": spec.output_len, "ignore_eos": True, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send_request(client: httpx.AsyncClient, base_url: str, model: str, spec: RequestSpec) -> RequestResult:
    """Send one streaming completion and time its tokens; failures are recorded, never raised."""
    result = RequestResult(spec.kind, len(spec.prompt_token_ids), spec.output_len, time.time())
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=completion_body(model, spec)) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:ERROR_TEXT_LIMIT]}"
            else:
                await read_events(response, result)
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        result.error = f"{type(error).__name__}: {error}"
    result.end_time = time.time()
    result.ok = result.error is None
    return result


async def read_events(response: httpx.Response, result: RequestResult) -> None:
    """Parse the SSE stream into ``result``; a stream that ends without [DONE] is an error.

    completion_tokens counts the token events until the usage event (if any) gives the server's count.
    """
    usage_tokens = None
    async for line in response.aiter_lines():
        now = time.time()
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            if usage_tokens is not None:
                result.completion_tokens = usage_tokens
            return
        event = json.loads(payload)
        if event.get("error"):
            result.error = f"stream error: {json.dumps(event['error'])[:ERROR_TEXT_LIMIT]}"
            return
        if event.get("choices") and not is_terminator(event, result):
            result.token_times.append(now)
            result.completion_tokens = len(result.token_times)
        if event.get("usage"):
            usage_tokens = event["usage"].get("completion_tokens")
            result.cached_tokens = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    result.error = "the stream ended without [DONE]"


def is_terminator(event: dict, result: RequestResult) -> bool:
    """An event that only closes the stream, carrying no token: empty text and a finish reason
    after every requested token came (llama.cpp's server sends one; vLLM and chunkserve put the
    finish reason on the last token's event). Counting it would add a fake near-zero TBT gap."""
    choice = event["choices"][0]
    return (not choice.get("text") and choice.get("finish_reason") is not None
            and len(result.token_times) >= result.output_len)


async def run_requests(specs: list[RequestSpec], base_url: str, model: str | None, api_key: str | None,
                       max_concurrency: int | None,
                       on_done: Callable[[RequestResult], None] | None = None) -> tuple[str, float, list[RequestResult]]:
    """Send every spec at its ``send_at`` (after the request it follows, if any); returns
    (model, wall start time, results in spec order).

    ``max_concurrency`` caps the requests in flight: a request due while the cap is reached waits,
    and its send_time is when it actually goes out. ``on_done`` is called after each request.
    """
    async with make_client(max(1, max_concurrency or len(specs)), api_key) as client:
        model = model or await fetch_model_name(client, base_url)
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        ended = [asyncio.Event() for _ in specs]
        start = time.time()

        async def one(index: int, spec: RequestSpec) -> RequestResult:
            if spec.after is None:
                await asyncio.sleep(max(0.0, start + spec.send_at - time.time()))
            else:
                await ended[spec.after].wait()
                await asyncio.sleep(spec.send_at)
            try:
                if gate is None:
                    result = await send_request(client, base_url, model, spec)
                else:
                    async with gate:
                        result = await send_request(client, base_url, model, spec)
            finally:
                ended[index].set()  # even on a bug or cancellation: the next turn must not wait forever
            if on_done is not None:
                on_done(result)
            return result

        results = await asyncio.gather(*(one(i, spec) for i, spec in enumerate(specs)))
    return model, start, list(results)

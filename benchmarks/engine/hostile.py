"""Replay the hostile requests of the robustness issue against a running `chunkserve serve`
while a few bystander streams run, and report what each did to the server and to them.

Start a server (any model; the tiny ones of the tests do, the default SmolLM2 is what the
issue used), note its pid, and run the cases against it:

    .venv/bin/chunkserve serve --port 8000 --api-key secret --admin-api-key admin-secret &
    SERVER_PID=$!
    .venv/bin/python -m benchmarks.engine.hostile --url http://127.0.0.1:8000 --api-key secret \\
        --admin-api-key admin-secret --pid $SERVER_PID --json hostile.json
    .venv/bin/python -m benchmarks.engine.hostile --cases nan_temperature,slowloris --slowloris-wait 10

(`--admin-api-key` is the server flag the fix adds; leave it out on a server without it.)
Each case prints one row: requests sent, answers by status class, 5xx count, bystander
requests failed (an HTTP error, an error event, a finish other than length, a transport
error) and their worst gap between two events, the worst /health latency seen while the
case ran, the server's RSS (with its children: the engine process) before, at peak and
after, and a verdict against what the fixed server should do. Between cases the script
waits for the server to drain (nothing running or waiting in /metrics).

Cases (`--cases all` or a comma list): nan_temperature, inf_temperature,
nan_repetition_penalty, tiny_repetition_penalty (1e-45), huge_top_k (2**63, temperature 1),
bool_token_ids, float_token_ids, string_max_tokens, unread_stream (a chat stream with
top_logprobs 20 that is never read for --unread-seconds; RSS is the thing to watch),
huge_prompt (a --huge-prompt-mb plain prompt and chat message: /health latency),
many_prompts (--many-prompts prompts, then the client disconnects: how long until the
server is idle), many_stop_token_ids (--many-stop-ids ids: the bystanders' worst gap),
slowloris (--slowloris-sockets connections with unfinished headers or bodies: how long
until the server closes them), side_channel (two cache_salts never share cached_tokens),
admin_endpoints (without the admin key: 404), bearer_case (`bearer KEY` is accepted).
Every case is bounded in time; the flags scale them down. The script reports and goes on
whatever the server does (errors, timeouts, a dead server); it never stops at a failed case.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx

# ----- the server's process: RSS from /proc ------------------------------------------------------


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            found.append(int(entry))
    return found


def tree_rss_mb(pid: int | None) -> float | None:
    """RSS of `pid` and all its descendants, MB; None without a pid or once it is gone."""
    if pid is None:
        return None
    total_kb, stack, seen = 0, [pid], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            with open(f"/proc/{current}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total_kb += int(line.split()[1])
        except OSError:
            if current == pid:
                return None
            continue
        stack.extend(_children(current))
    return total_kb / 1024


# ----- the run's context --------------------------------------------------------------------


@dataclass
class CaseResult:
    name: str
    sent: int = 0
    statuses: Counter = field(default_factory=Counter)  # "2xx", "4xx", "5xx", "error" (no answer)
    bystanders_ok: int = 0
    bystanders_failed: int = 0
    bystander_failures: list[str] = field(default_factory=list)
    bystander_worst_gap_s: float = 0.0
    health_worst_s: float = 0.0
    health_failures: int = 0
    rss_before_mb: float | None = None
    rss_peak_mb: float | None = None
    rss_after_mb: float | None = None
    drained_s: float | None = None  # time to idle after the case; None: not idle in time
    duration_s: float = 0.0
    verdict: str = "?"
    notes: list[str] = field(default_factory=list)

    def count(self, status: int | None) -> None:
        self.sent += 1
        self.statuses["error" if status is None else f"{status // 100}xx"] += 1

    @property
    def five_xx(self) -> int:
        return self.statuses.get("5xx", 0)


class Context:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.base_url = args.url.rstrip("/")
        parsed = urlparse(self.base_url)
        self.host, self.port = parsed.hostname or "127.0.0.1", parsed.port or (443 if parsed.scheme == "https" else 80)
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.client = httpx.AsyncClient(base_url=self.base_url, headers=self.headers, timeout=args.timeout,
                                        limits=httpx.Limits(max_connections=64))
        self.max_model_len = 2048

    async def post(self, result: CaseResult, path: str, content: bytes | str | None = None,
                   json_body: Any = None, headers: dict[str, str] | None = None) -> tuple[int | None, bytes]:
        """POST, read the whole answer, count its status class; (status or None, body)."""
        data = content.encode() if isinstance(content, str) else content
        if json_body is not None:
            data = json.dumps(json_body).encode()
        for attempt in range(2):
            try:
                response = await self.client.post(path, content=data, headers={"Content-Type": "application/json",
                                                                               **(headers or {})})
                result.count(response.status_code)
                return response.status_code, response.content
            except (httpx.ReadError, httpx.RemoteProtocolError) as error:
                if attempt == 0:  # a kept-alive connection the server dropped (it does after a 500): once more
                    result.notes.append(f"{path}: {type(error).__name__} on a reused connection; retried")
                    continue
                result.count(None)
                result.notes.append(f"{path}: {type(error).__name__}: {error}"[:200])
            except httpx.HTTPError as error:
                result.count(None)
                result.notes.append(f"{path}: {type(error).__name__}: {error}"[:200])
                break
        return None, b""

    async def metrics(self) -> dict[str, float]:
        response = await self.client.get("/metrics", timeout=10)
        values: dict[str, float] = {}
        for line in response.text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name_labels, _, value = line.rpartition(" ")
            name = name_labels.split("{", 1)[0]
            labels = name_labels[len(name):]
            key = name + ("{" + ",".join(sorted(p for p in labels.strip("{}").split(",")
                                                if p and not p.startswith(("model_name=", "engine=")))) + "}")
            try:
                values[key] = float(value)
            except ValueError:
                pass
        return values

    async def in_flight(self) -> float | None:
        try:
            m = await self.metrics()
            return m.get("chunkserve:num_requests_running{}", 0) + m.get("chunkserve:num_requests_waiting{}", 0)
        except (httpx.HTTPError, ValueError):
            return None

    async def wait_idle(self, timeout_s: float, besides: int = 0) -> float | None:
        """Seconds until nothing runs or waits (but up to `besides` requests: the bystanders');
        None if that never happened within timeout_s."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            in_flight = await self.in_flight()
            if in_flight is not None and in_flight <= besides:
                return time.monotonic() - start
            await asyncio.sleep(0.2)
        return None


# ----- bystanders and the health/RSS monitor ------------------------------------------------


async def bystander(ctx: Context, result: CaseResult, stop: asyncio.Event, number: int) -> None:
    """Streams one ordinary completion after another until `stop`; each must end properly."""
    tokens = ctx.args.bystander_tokens
    body = {"prompt": f"Bystander {number} says: once upon a time", "max_tokens": tokens, "ignore_eos": True,
            "temperature": 0, "stream": True}
    while not stop.is_set():
        problem, last = None, time.monotonic()
        events: list[str] = []
        try:
            async with ctx.client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    problem = f"HTTP {response.status_code}: {(await response.aread())[:150]!r}"
                else:
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            now = time.monotonic()
                            result.bystander_worst_gap_s = max(result.bystander_worst_gap_s, now - last)
                            last = now
                            events.append(line[6:])
        except httpx.HTTPError as error:
            problem = f"{type(error).__name__}: {error}"
        if problem is None:
            payloads = [json.loads(e) for e in events if e != "[DONE]"]
            errors = [p["error"] for p in payloads if "error" in p]
            finishes = [c.get("finish_reason") for p in payloads for c in p.get("choices", []) if c.get("finish_reason")]
            if errors:
                problem = f"error event: {errors[0]}"
            elif not events or events[-1] != "[DONE]" or finishes != ["length"]:
                problem = f"ended {finishes[-1:] or events[-1:]} after {len(payloads)} events"
        if problem is None:
            result.bystanders_ok += 1
        else:
            result.bystanders_failed += 1
            if len(result.bystander_failures) < 5:
                result.bystander_failures.append(problem[:200])
            await asyncio.sleep(0.2)  # a dead server: do not spin


async def monitor(ctx: Context, result: CaseResult, stop: asyncio.Event) -> None:
    """/health latency (one probe at a time, every 0.2 s) and the server's peak RSS."""
    async with httpx.AsyncClient(base_url=ctx.base_url, timeout=ctx.args.timeout) as health_client:
        while not stop.is_set():
            rss = tree_rss_mb(ctx.args.pid)
            if rss is not None:
                result.rss_peak_mb = max(result.rss_peak_mb or 0.0, rss)
            start = time.monotonic()
            try:
                ok = (await health_client.get("/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            result.health_worst_s = max(result.health_worst_s, time.monotonic() - start)
            result.health_failures += not ok
            try:
                await asyncio.wait_for(stop.wait(), timeout=0.2)
            except asyncio.TimeoutError:
                pass


# ----- the cases ---------------------------------------------------------------------------------

Case = Callable[[Context, CaseResult], Awaitable[str]]  # returns the verdict
CASES: dict[str, Case] = {}


def case(function: Case) -> Case:
    CASES[function.__name__] = function
    return function


def expect_all(result: CaseResult, wanted: set[str], what: str) -> str:
    got = {k for k, v in result.statuses.items() if v}
    bad = []
    if not got <= wanted:
        bad.append(f"answers { {k: v for k, v in result.statuses.items() if v} }, want only {sorted(wanted)} ({what})")
    if result.bystanders_failed:
        bad.append(f"{result.bystanders_failed} bystander requests failed")
    return "PASS" if not bad else "FAIL: " + "; ".join(bad)


async def _three_endpoints(ctx: Context, result: CaseResult, sampling: str, prompt: str = '"Hello"',
                           max_tokens: str = "8") -> None:
    """The same hostile sampling fields on /v1/completions, a chat stream and /generate.
    `sampling` is raw JSON text (`"temperature": NaN`), so any token goes out as is."""
    extra = f", {sampling}" if sampling else ""
    await ctx.post(result, "/v1/completions", f'{{"prompt": {prompt}, "max_tokens": {max_tokens}{extra}}}')
    status, data = await ctx.post(result, "/v1/chat/completions",
                                  f'{{"messages": [{{"role": "user", "content": "Hi"}}], "max_tokens": {max_tokens}, '
                                  f'"stream": true{extra}}}')
    if status == 200 and b'"error"' in data:
        result.statuses["2xx"] -= 1
        result.statuses["5xx"] += 1  # an in-band error event is a 5xx sent after the headers
        result.notes.append("the chat stream carried an error event")
    await ctx.post(result, "/generate", f'{{"text": "Hello", "sampling_params": {{"max_new_tokens": {max_tokens}'
                                        f'{extra}}}}}')


@case
async def nan_temperature(ctx: Context, result: CaseResult) -> str:
    await _three_endpoints(ctx, result, '"temperature": NaN')
    return expect_all(result, {"4xx"}, "NaN is not a temperature")


@case
async def inf_temperature(ctx: Context, result: CaseResult) -> str:
    await _three_endpoints(ctx, result, '"temperature": Infinity')
    await _three_endpoints(ctx, result, '"temperature": 1e400')
    return expect_all(result, {"4xx"}, "Infinity and 1e400 are not temperatures")


@case
async def nan_repetition_penalty(ctx: Context, result: CaseResult) -> str:
    await _three_endpoints(ctx, result, '"repetition_penalty": NaN')
    return expect_all(result, {"4xx"}, "NaN is not a penalty")


@case
async def tiny_repetition_penalty(ctx: Context, result: CaseResult) -> str:
    await _three_endpoints(ctx, result, '"repetition_penalty": 1e-45')
    return expect_all(result, {"2xx", "4xx"}, "served or refused, never a failed step")


@case
async def huge_top_k(ctx: Context, result: CaseResult) -> str:
    await _three_endpoints(ctx, result, '"temperature": 1, "top_k": 9223372036854775808')
    await _three_endpoints(ctx, result, '"temperature": 1, "top_k": 18446744073709551616')
    return expect_all(result, {"2xx", "4xx"}, "served or refused, never a failed step")


@case
async def bool_token_ids(ctx: Context, result: CaseResult) -> str:
    await ctx.post(result, "/v1/completions", '{"prompt": [true, false], "max_tokens": 4}')
    await ctx.post(result, "/generate", '{"input_ids": [true, false], "sampling_params": {"max_new_tokens": 4}}')
    await ctx.post(result, "/v1/completions", '{"prompt": "hi", "max_tokens": 4, "stop_token_ids": [true]}')
    return expect_all(result, {"4xx"}, "bools are not token ids")


@case
async def float_token_ids(ctx: Context, result: CaseResult) -> str:
    await ctx.post(result, "/v1/completions", '{"prompt": [1.0, 2.0], "max_tokens": 4}')
    await ctx.post(result, "/v1/completions", '{"prompt": [[1.0, 2.0]], "max_tokens": 4}')
    await ctx.post(result, "/generate", '{"input_ids": [1.0, 2.0], "sampling_params": {"max_new_tokens": 4}}')
    return expect_all(result, {"4xx"}, "floats are not token ids")


@case
async def string_max_tokens(ctx: Context, result: CaseResult) -> str:
    await ctx.post(result, "/v1/completions", '{"prompt": "hi", "max_tokens": "4"}')
    await ctx.post(result, "/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
                                                   '"max_completion_tokens": "4"}')
    await ctx.post(result, "/generate", '{"text": "hi", "sampling_params": {"max_new_tokens": "4"}}')
    return expect_all(result, {"4xx"}, "strings are not numbers")


async def _raw_connection(ctx: Context, receive_buffer: int | None = None) -> tuple[asyncio.StreamReader,
                                                                                   asyncio.StreamWriter]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (ctx.host, ctx.port))
    return await asyncio.open_connection(sock=sock)


def _request_bytes(ctx: Context, path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {ctx.host}:{ctx.port}", "Content-Type: application/json",
             f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in {**ctx.headers, **(headers or {})}.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _open_unread_streams(ctx: Context, result: CaseResult,
                               body: bytes) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """--unread-streams connections with a small receive buffer, each sent the streaming request
    and then left unread."""
    writers = []
    for _ in range(ctx.args.unread_streams):
        try:
            reader, writer = await _raw_connection(ctx, receive_buffer=4096)
            writer.write(_request_bytes(ctx, "/v1/chat/completions", body))
            await writer.drain()
            writers.append((reader, writer))
            result.sent += 1
        except OSError as error:
            result.count(None)
            result.notes.append(f"connect: {error}")
    return writers


async def _read_what_each_holds(writers: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]],
                                result: CaseResult) -> tuple[int, float]:
    """Reads each stream for up to 3 s, counts its response status and closes it: a cut stream
    ends (EOF), a live one goes on. Returns how many ended and the MB read."""
    ended, unread_mb = 0, 0.0
    for reader, writer in writers:
        data, deadline = b"", time.monotonic() + 3
        try:
            while time.monotonic() < deadline:
                chunk = await asyncio.wait_for(reader.read(1 << 20), timeout=max(0.01, deadline - time.monotonic()))
                if not chunk:
                    ended += 1
                    break
                data += chunk[: max(0, 200 - len(data))]
                unread_mb += len(chunk) / 1e6
        except (asyncio.TimeoutError, OSError):
            pass
        status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") and data[9:12].isdigit() else None
        result.statuses["error" if status is None else f"{status // 100}xx"] += 1
        writer.close()
    return ended, unread_mb


@case
async def unread_stream(ctx: Context, result: CaseResult) -> str:
    """Chat streams with top_logprobs 20 whose clients never read (a small receive buffer,
    nothing read) for --unread-seconds. The fixed server aborts such a stream once its
    output queue passes a limit; the old one buffers every event. Only a long output shows
    the growth: use a server whose max_model_len allows thousands of tokens (the default
    model's), or several --unread-streams."""
    max_tokens = ctx.args.unread_max_tokens or max(16, ctx.max_model_len - 64)
    body = json.dumps({"messages": [{"role": "user", "content": "Write a very long story."}],
                       "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "logprobs": True,
                       "top_logprobs": 20}).encode()
    writers = await _open_unread_streams(ctx, result, body)
    before = await ctx.metrics() if writers else {}
    await asyncio.sleep(ctx.args.unread_seconds)
    in_flight = await ctx.in_flight()
    after = await ctx.metrics() if writers else {}
    # What the server did with the unread streams: still generating, or cut them?
    ended, unread_mb = await _read_what_each_holds(writers, result)
    busy = None if in_flight is None else max(0.0, in_flight - ctx.args.bystanders)
    result.notes.append(f"after {ctx.args.unread_seconds:.0f}s unread: {busy} requests in flight besides the "
                        f"bystanders; then {ended}/{len(writers)} streams ended within 3s of reading "
                        f"({unread_mb:.1f} MB read)")
    counters = {k: after[k] - before.get(k, 0) for k in after
                if any(w in k for w in ("unread", "slow_consumer", "backpressure", "queue_overflow", "output_queue"))
                and after[k] != before.get(k, 0)}
    if counters:
        result.notes.append(f"metrics that moved: {counters}")
    growth = None if result.rss_before_mb is None or result.rss_peak_mb is None else \
        result.rss_peak_mb - result.rss_before_mb
    if result.bystanders_failed:
        return f"FAIL: {result.bystanders_failed} bystander requests failed"
    if growth is not None:
        result.notes.append(f"RSS grew {growth:.0f} MB while the streams were unread")
        if growth > ctx.args.rss_limit_mb:
            return f"FAIL: RSS grew {growth:.0f} MB (> --rss-limit-mb {ctx.args.rss_limit_mb})"
    if counters or (writers and ended == len(writers) and busy == 0):
        return "PASS (the server cut the unread streams)"
    if max_tokens * len(writers) < 4000:
        return (f"? {len(writers)} x {max_tokens} tokens is too little output to show the growth "
                "(--unread-streams, or a server with a longer max_model_len)")
    return "PASS" if growth is not None else "? (give --pid to judge by RSS)"


@case
async def huge_prompt(ctx: Context, result: CaseResult) -> str:
    """A --huge-prompt-mb plain prompt, then a chat message as large: /health must stay fast."""
    size = int(ctx.args.huge_prompt_mb * 1_000_000)
    text = ("lorem ipsum dolor sit amet " * (size // 27 + 1))[:size]
    await ctx.post(result, "/v1/completions", json_body={"prompt": text, "max_tokens": 4})
    await ctx.post(result, "/v1/chat/completions",
                   json_body={"messages": [{"role": "user", "content": text}], "max_tokens": 4})
    verdict = expect_all(result, {"4xx"}, "too long for the model")
    if result.health_worst_s > ctx.args.health_slo_s:
        slow = f"/health took {result.health_worst_s:.1f}s (> {ctx.args.health_slo_s}s)"
        verdict = f"FAIL: {slow}" + ("; " + verdict[6:] if verdict.startswith("FAIL") else "")
    return verdict


@case
async def many_stop_token_ids(ctx: Context, result: CaseResult) -> str:
    """--many-stop-ids stop_token_ids: refused, or served without stalling the bystanders."""
    ids = ",".join(str(i % 1000) for i in range(ctx.args.many_stop_ids))
    await ctx.post(result, "/v1/completions", f'{{"prompt": "hi", "max_tokens": 8, "stop_token_ids": [{ids}]}}')
    verdict = expect_all(result, {"2xx", "4xx"}, "refused or served")
    if result.bystander_worst_gap_s > ctx.args.stall_limit_s:
        stall = f"a bystander stalled {result.bystander_worst_gap_s:.1f}s (> {ctx.args.stall_limit_s}s)"
        verdict = f"FAIL: {stall}" + ("; " + verdict[6:] if verdict.startswith("FAIL") else "")
    return verdict


@case
async def slowloris(ctx: Context, result: CaseResult) -> str:
    """--slowloris-sockets connections: half stop in the middle of their headers, half send
    headers announcing a body they never finish. How long until the server closes each?"""
    start = time.monotonic()
    conns = []
    for i in range(ctx.args.slowloris_sockets):
        try:
            reader, writer = await _raw_connection(ctx)
        except OSError as error:
            result.count(None)
            result.notes.append(f"connect {i}: {error}")
            continue
        if i % 2 == 0:
            writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {ctx.host}\r\nX-Slow: ".encode())
        else:
            headers = "".join(f"{k}: {v}\r\n" for k, v in ctx.headers.items())
            writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {ctx.host}\r\n{headers}"
                         f"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{{\"prompt\": ".encode())
        await writer.drain()
        conns.append((reader, writer))
        result.sent += 1

    async def closed_after(reader: asyncio.StreamReader) -> tuple[float | None, bytes]:
        """Seconds until the server closed the connection (reading any answer it sent)."""
        head = b""
        try:
            while True:
                chunk = await reader.read(4096)
                if not chunk:
                    return time.monotonic() - start, head
                head += chunk[: max(0, 200 - len(head))]
        except OSError:
            return time.monotonic() - start, head

    tasks = [asyncio.ensure_future(closed_after(reader)) for reader, _ in conns]
    await asyncio.wait(tasks, timeout=ctx.args.slowloris_wait) if tasks else None
    times = []
    for task, (_, writer) in zip(tasks, conns):
        if task.done():
            seconds, head = task.result()
            times.append(seconds)
            status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else None
            result.statuses["closed" if status is None else f"{status // 100}xx"] += 1
        else:
            task.cancel()
            result.statuses["still open"] += 1
        writer.close()
    open_left = len(conns) - len(times)
    if times:
        times.sort()
        result.notes.append(f"closed by the server: {len(times)}/{len(conns)}, median {times[len(times) // 2]:.1f}s, "
                            f"last {times[-1]:.1f}s")
    if open_left:
        return f"FAIL: {open_left}/{len(conns)} connections still open after {ctx.args.slowloris_wait:.0f}s"
    return "PASS" if not result.bystanders_failed else f"FAIL: {result.bystanders_failed} bystander requests failed"


@case
async def side_channel(ctx: Context, result: CaseResult) -> str:
    """Two users with different cache_salt send the same long prompt: the second must see
    cached_tokens 0; the same salt again must hit the cache (so the check means something)."""
    prompt = f"{uuid.uuid4()} " + "The same long system prompt that two users share. " * 12

    async def cached(salt: str | None) -> int | None:
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": 1}
        if salt is not None:
            body["cache_salt"] = salt
        status, data = await ctx.post(result, "/v1/completions", json_body=body)
        if status != 200:
            result.notes.append(f"salt {salt!r}: HTTP {status} {data[:120]!r}")
            return None
        return json.loads(data)["usage"]["prompt_tokens_details"]["cached_tokens"]

    salt_a, salt_b = f"alice-{uuid.uuid4()}", f"bob-{uuid.uuid4()}"
    first_a, other_b, again_a, unsalted = await cached(salt_a), await cached(salt_b), await cached(salt_a), \
        await cached(None)
    result.notes.append(f"cached_tokens: salt A {first_a}, salt B {other_b}, salt A again {again_a}, "
                        f"no salt {unsalted}")
    if None in (first_a, other_b, again_a, unsalted):
        return "FAIL: a request was refused (is cache_salt accepted?)"
    if other_b or unsalted:
        return f"FAIL: another salt (or none) read {other_b or unsalted} cached tokens of salt A's prompt"
    if not again_a:
        return "? the same salt got no cache hit (prefix caching off?)"
    return "PASS"


@case
async def admin_endpoints(ctx: Context, result: CaseResult) -> str:
    """/reset_prefix_cache, /debug/steps and /debug/check with the ordinary key. A server
    without --admin-api-key answers 404; with one (give it to this script), the ordinary key
    is refused and the admin key opens /debug/check."""
    calls = [("POST", "/reset_prefix_cache"), ("GET", "/debug/steps?last=1"), ("GET", "/debug/check")]
    seen = {}
    for method, path in calls:
        try:
            response = await ctx.client.request(method, path)
            result.count(response.status_code)
            seen[path] = response.status_code
        except httpx.HTTPError as error:
            result.count(None)
            seen[path] = repr(error)
    result.notes.append(f"with the ordinary key: {seen}")
    if not ctx.args.admin_api_key:
        open_to_users = [p for p, s in seen.items() if s != 404]
        return "PASS" if not open_to_users else f"FAIL: not 404 without an admin key: {open_to_users}"
    open_to_users = [p for p, s in seen.items() if not isinstance(s, int) or s < 400]
    try:
        response = await ctx.client.get("/debug/check", headers={"Authorization": f"Bearer {ctx.args.admin_api_key}"})
        result.count(response.status_code)
        result.notes.append(f"/debug/check with the admin key: {response.status_code} {response.text[:200]}")
        admin_ok = response.status_code == 200
    except httpx.HTTPError as error:
        result.count(None)
        result.notes.append(f"/debug/check with the admin key: {error!r}")
        admin_ok = False
    if open_to_users:
        return f"FAIL: the ordinary key opened {open_to_users}"
    return "PASS" if admin_ok else "FAIL: the admin key did not open /debug/check"


@case
async def bearer_case(ctx: Context, result: CaseResult) -> str:
    """RFC 6750's scheme name is case-insensitive: `bearer KEY` and `BEARER KEY` are accepted."""
    if not ctx.args.api_key:
        return "N/A (no --api-key)"
    seen = {}
    for scheme in ("bearer", "BEARER", "BeArEr"):
        try:
            response = await ctx.client.get("/v1/models", headers={"Authorization": f"{scheme} {ctx.args.api_key}"})
            result.count(response.status_code)
            seen[scheme] = response.status_code
        except httpx.HTTPError as error:
            result.count(None)
            seen[scheme] = repr(error)
    result.notes.append(f"statuses: {seen}")
    refused = [s for s, code in seen.items() if code != 200]
    return "PASS" if not refused else f"FAIL: refused {refused}"


@case
async def many_prompts(ctx: Context, result: CaseResult) -> str:
    """--many-prompts prompts in one request; the client gives up after --many-prompts-wait
    seconds. Either refused, or every prompt aborted soon after the disconnect. Last in
    `all`: on a server that keeps generating for a gone client, it stays busy a while."""
    body = {"prompt": [f"prompt number {i} says" for i in range(ctx.args.many_prompts)],
            "max_tokens": ctx.args.many_prompts_tokens, "ignore_eos": True}
    request = asyncio.ensure_future(ctx.post(result, "/v1/completions", json_body=body))
    done, _ = await asyncio.wait([request], timeout=ctx.args.many_prompts_wait)
    if done:
        status, data = request.result()
        result.notes.append(f"answered {status} before the disconnect: {data[:120]!r}")
        if status is not None and 400 <= status < 500 and not result.bystanders_failed:
            return "PASS (refused)"
    else:
        request.cancel()  # closes the connection: a disconnect
        await asyncio.gather(request, return_exceptions=True)
        result.sent += 1
        result.statuses["hung up"] += 1
        result.notes.append(f"no answer within {ctx.args.many_prompts_wait:.0f}s: hung up")
    start = time.monotonic()
    drained = await ctx.wait_idle(ctx.args.drain_timeout, besides=ctx.args.bystanders)
    if drained is None:
        left = (await ctx.in_flight() or 0) - ctx.args.bystanders
        return f"FAIL: {left:.0f} prompts still in flight {ctx.args.drain_timeout:.0f}s after the disconnect"
    result.notes.append(f"idle {time.monotonic() - start:.1f}s after the disconnect")
    if result.five_xx or result.bystanders_failed:
        return f"FAIL: {result.five_xx} 5xx, {result.bystanders_failed} bystander requests failed"
    if drained > 5:
        return f"FAIL: {drained:.1f}s to drain after the disconnect (> 5s)"
    return "PASS"


# ----- running and reporting -------------------------------------------------------------------


async def run_case(ctx: Context, name: str) -> CaseResult:
    result = CaseResult(name)
    if await ctx.wait_idle(ctx.args.drain_timeout) is None:
        result.notes.append(f"the server was still busy ({await ctx.in_flight()} in flight) when the case began")
    result.rss_before_mb = tree_rss_mb(ctx.args.pid)
    result.rss_peak_mb = result.rss_before_mb
    stop = asyncio.Event()
    helpers = [asyncio.ensure_future(monitor(ctx, result, stop))]
    helpers += [asyncio.ensure_future(bystander(ctx, result, stop, i)) for i in range(ctx.args.bystanders)]
    await asyncio.sleep(0.5)  # the bystanders are streaming before the hostile requests go out
    start = time.monotonic()
    try:
        result.verdict = await asyncio.wait_for(CASES[name](ctx, result), timeout=ctx.args.case_timeout)
    except asyncio.TimeoutError:
        result.verdict = f"FAIL: the case did not finish within --case-timeout {ctx.args.case_timeout:.0f}s"
    except Exception as error:  # noqa: BLE001  (the script reports and goes on, whatever the server did)
        result.verdict = f"ERROR: {type(error).__name__}: {error}"[:300]
    result.duration_s = time.monotonic() - start
    stop.set()
    try:
        await asyncio.wait_for(asyncio.gather(*helpers, return_exceptions=True), timeout=ctx.args.timeout)
    except asyncio.TimeoutError:
        for helper in helpers:
            helper.cancel()
        result.notes.append("a bystander did not finish its last request")
    result.rss_after_mb = tree_rss_mb(ctx.args.pid)
    result.drained_s = await ctx.wait_idle(ctx.args.drain_timeout)
    if result.drained_s is None:
        result.notes.append(f"the server was not idle {ctx.args.drain_timeout:.0f}s after the case")
    if result.bystander_failures:
        result.notes.append(f"bystander failures, e.g. {result.bystander_failures[0]}")
    if result.health_failures:
        result.notes.append(f"/health failed {result.health_failures} times (an error or not 200)")
    return result


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def print_row(result: CaseResult) -> None:
    s = result.statuses
    classes = " ".join(f"{k}:{v}" for k, v in sorted(s.items()) if v) or "-"
    print(f"{result.name:<24} {result.sent:>5} {classes:<26} {result.five_xx:>4} "
          f"{result.bystanders_failed:>3}/{result.bystanders_ok + result.bystanders_failed:<4} "
          f"{result.bystander_worst_gap_s:>7.2f} {result.health_worst_s:>8.2f} "
          f"{_mb(result.rss_before_mb):>6}/{_mb(result.rss_peak_mb):>6}/{_mb(result.rss_after_mb):>6} "
          f"{result.duration_s:>6.1f}  {result.verdict}")
    for note in result.notes:
        print(f"{'':<26}- {note}")
    sys.stdout.flush()


HEADER = (f"{'case':<24} {'sent':>5} {'answers':<26} {'5xx':>4} {'bys.fail':>8} {'gap s':>7} {'health s':>8} "
          f"{'RSS MB before/peak/after':>20} {'time s':>6}  verdict")


async def main_async(args: argparse.Namespace) -> list[CaseResult]:
    ctx = Context(args)
    try:
        models = (await ctx.client.get("/v1/models", timeout=10)).json()
        ctx.max_model_len = int(models["data"][0].get("max_model_len") or ctx.max_model_len)
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as error:
        print(f"warning: GET /v1/models failed ({error!r}); assuming max_model_len {ctx.max_model_len}")
    names = list(CASES) if args.cases == "all" else [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; known: {', '.join(CASES)}")
    print(f"server {ctx.base_url}, max_model_len {ctx.max_model_len}, pid {args.pid}, {args.bystanders} bystanders")
    print(HEADER)
    results = []
    for name in names:
        result = await run_case(ctx, name)
        print_row(result)
        results.append(result)
    await ctx.client.aclose()
    failed = [r.name for r in results if not r.verdict.startswith(("PASS", "N/A"))]
    print(f"\n{len(results) - len(failed)}/{len(results)} cases passed" + (f"; not: {', '.join(failed)}" if failed else ""))
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--api-key", default=os.environ.get("CHUNKSERVE_API_KEY"), help="the server's --api-key")
    parser.add_argument("--admin-api-key", default=None, help="the server's --admin-api-key, if it has one")
    parser.add_argument("--pid", type=int, default=None, help="the server's pid: its RSS (and its children's)")
    parser.add_argument("--cases", default="all", help=f"'all' or a comma list of: {', '.join(CASES)}")
    parser.add_argument("--json", default=None, help="write every case's result to this file")
    parser.add_argument("--bystanders", type=int, default=3, help="ordinary streams running through every case")
    parser.add_argument("--bystander-tokens", type=int, default=32, help="max_tokens of each bystander request")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds any one HTTP request may take")
    parser.add_argument("--case-timeout", type=float, default=300.0, help="seconds any one case may take")
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds to wait for idle after a case")
    parser.add_argument("--health-slo-s", type=float, default=1.0, help="worst /health latency a case may cause")
    parser.add_argument("--stall-limit-s", type=float, default=1.0, help="worst bystander gap a case may cause")
    parser.add_argument("--unread-streams", type=int, default=1, help="unread_stream: streams nobody reads")
    parser.add_argument("--unread-seconds", type=float, default=30.0, help="unread_stream: how long they stay unread")
    parser.add_argument("--unread-max-tokens", type=int, default=None,
                        help="unread_stream: max_tokens of each (default: max_model_len - 64)")
    parser.add_argument("--rss-limit-mb", type=float, default=500.0, help="unread_stream: RSS growth that fails")
    parser.add_argument("--huge-prompt-mb", type=float, default=15.0, help="huge_prompt: prompt size, MB")
    parser.add_argument("--many-prompts", type=int, default=3000, help="many_prompts: prompts in the request")
    parser.add_argument("--many-prompts-tokens", type=int, default=16, help="many_prompts: max_tokens of each")
    parser.add_argument("--many-prompts-wait", type=float, default=3.0, help="many_prompts: seconds before hanging up")
    parser.add_argument("--many-stop-ids", type=int, default=2_000_000, help="many_stop_token_ids: how many ids")
    parser.add_argument("--slowloris-sockets", type=int, default=200, help="slowloris: connections opened")
    parser.add_argument("--slowloris-wait", type=float, default=60.0, help="slowloris: seconds to wait for closes")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = asyncio.run(main_async(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**asdict(r), "statuses": dict(r.statuses)} for r in results], f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

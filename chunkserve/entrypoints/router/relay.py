"""One client request through a prefill and a decode instance at once (SGLang's PD mini_lb).

Both instances get the client's body with three fields added, the same in both copies:
`bootstrap_host` and `bootstrap_port` (the prefill instance's bootstrap server, where the KV is
handed over) and `bootstrap_room` (random per request: it pairs the two halves). The prefill
instance computes the prompt and pushes its KV; the decode instance waits for it and answers.

    client ──body──▶ router ──body + bootstrap──▶ prefill   answer read to the end, discarded
                            └─body + bootstrap──▶ decode    answer ──▶ client, unchanged

The client gets the decode's status, content type and bytes, each chunk forwarded as it comes
(an SSE event is never held back to be merged with the next); a decode that refuses the request
(an error status) has the prefill half cancelled at once, as it will never take that KV. The
prefill's answer matters only when it fails before the client has seen anything: an error status, or no connection,
that arrives before the decode's status line (at any time for a non-streaming request) is what
the client gets, and the decode request is cancelled. A later prefill failure is only logged.

Cancelling an upstream request closes its connection, which the upstream server takes as an
abort; a client that disconnects, at any point, cancels both. The whole exchange runs in
`PDExchange.__call__` rather than in the route so that it can watch the client's connection
from the first upstream byte to the last.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass

import httpx
from starlette.types import Receive, Scope, Send

from chunkserve.entrypoints.router.metrics import RouterMetrics
from chunkserve.entrypoints.router.pool import Instance, InstancePool, Role

logger = logging.getLogger(__name__)
CLIENT_GONE = 499  # the status a request is counted under when its client left first (nginx's)
FORWARDED_REQUEST_HEADERS = ("authorization",)
FORWARDED_RESPONSE_HEADERS = (b"content-type", b"content-encoding", b"retry-after")
MAX_LOGGED_BODY_CHARS = 500


@dataclass
class Answer:
    """A whole response, sent at once."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    async def send(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


def error_answer(status: int, message: str, error_type: str, retry_after: str | None = None) -> Answer:
    """OpenAI's error body. Written here rather than imported from the server, whose modules
    reach into chunkserve.core: the router stays free of the engine's layers."""
    body = {"error": {"message": message, "type": error_type, "param": None, "code": status}}
    headers = [(b"content-type", b"application/json")]
    if retry_after is not None:
        headers.append((b"retry-after", retry_after.encode()))
    return Answer(status, headers, json.dumps(body).encode())


def upstream_headers(client_headers: Mapping[str, str]) -> dict[str, str]:
    """What an upstream request carries of the client's: its credentials, and its accepted
    encodings (bytes are forwarded as they come, so the client must be able to read them)."""
    headers = {name: client_headers[name] for name in FORWARDED_REQUEST_HEADERS if name in client_headers}
    headers["accept-encoding"] = client_headers.get("accept-encoding", "identity")
    return headers


def response_headers(response: httpx.Response) -> list[tuple[bytes, bytes]]:
    return [(name, value) for name, value in response.headers.raw if name.lower() in FORWARDED_RESPONSE_HEADERS]


@dataclass(frozen=True)
class Relay:
    """What every exchange shares."""

    client: httpx.AsyncClient  # one pool of upstream connections; no read timeout
    pool: InstancePool
    metrics: RouterMetrics
    timeout_s: float  # a whole request, its stream included
    retry_after: str  # told to clients while a role has no healthy instance (the check interval)

    def unavailable(self, role: Role) -> Answer:
        return error_answer(503, f"no healthy {role} instance", "service_unavailable", self.retry_after)

    def unreachable(self, instance: Instance, error: httpx.TransportError, mid_answer: bool = False) -> Answer:
        """`mid_answer`: the instance dropped its connection after its headers, gone as one that
        cannot be reached (a killed process does either, by when it dies): the request was not
        served, and the client may retry it elsewhere."""
        self.pool.mark_unreachable(instance, error)
        what = "was lost mid-answer" if mid_answer else "could not be reached"
        return error_answer(503, f"the {instance.role} instance {instance.url} {what} ({error!r})",
                            "service_unavailable", self.retry_after)

    def timed_out(self) -> Answer:
        return error_answer(504, f"no answer within --request-timeout {self.timeout_s:g} s", "timeout")

    async def open(self, instance: Instance, request: httpx.Request) -> httpx.Response:
        """The upstream's status line and headers; its body is streamed by the caller."""
        try:
            response = await self.client.send(request, stream=True)
        except httpx.TransportError:
            self.metrics.upstream_answered(instance.role, instance.url, "error")
            raise
        self.metrics.upstream_answered(instance.role, instance.url, response.status_code)
        return response

    async def fetch(self, instance: Instance, path: str, client_headers: Mapping[str, str]) -> Answer:
        """An instance's whole answer to a GET (503 when it cannot be reached)."""
        request = self.client.build_request("GET", instance.url + path, headers=upstream_headers(client_headers))
        try:
            response, body = await asyncio.wait_for(self._read(instance, request), self.timeout_s)
        except httpx.TransportError as error:
            return self.unreachable(instance, error)
        except asyncio.TimeoutError:
            return self.timed_out()
        return Answer(response.status_code, response_headers(response), body)

    async def _read(self, instance: Instance, request: httpx.Request) -> tuple[httpx.Response, bytes]:
        response = await self.open(instance, request)
        try:
            return response, b"".join([chunk async for chunk in response.aiter_raw()])
        finally:
            await response.aclose()


class PDExchange:
    """The ASGI response to a POST to /v1/completions, /v1/chat/completions or /generate."""

    def __init__(self, relay: Relay, route: str, body: bytes, headers: Mapping[str, str]) -> None:
        self.relay = relay
        self.route = route
        self.body = body
        self.headers_out = upstream_headers(headers)
        self.status: int | None = None  # once the client's status line is sent
        self.complete = False  # once the client's answer is sent to its end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrival = time.monotonic()

        async def tracked_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                self.status = message["status"]
            await send(message)
            self.complete = message["type"] == "http.response.body" and not message.get("more_body", False)

        exchange = asyncio.create_task(self._exchange(tracked_send))
        client_gone = asyncio.create_task(_disconnect(receive))
        try:
            await asyncio.wait({exchange, client_gone}, return_when=asyncio.FIRST_COMPLETED)
            if not self.complete:  # the client left (uvicorn reports a disconnect once the answer is sent, too)
                exchange.cancel()  # closes both upstream connections; a no-op when the exchange is over
            await asyncio.wait({exchange})
        finally:
            client_gone.cancel()
            if not exchange.done():  # this task was cancelled: the server is stopping
                exchange.cancel()
                await asyncio.wait({exchange})
            self.relay.metrics.request_done(self.route, self.status or CLIENT_GONE, time.monotonic() - arrival)
        if exchange.cancelled():
            logger.info("the client of a %s request left; its upstream requests are cancelled", self.route)
        else:
            exchange.result()  # re-raises a failure

    async def _exchange(self, send: Send) -> None:
        try:
            await asyncio.wait_for(self._answer(send), self.relay.timeout_s)
        except asyncio.TimeoutError:
            logger.warning("a %s request ran past --request-timeout %g s; its upstream requests are cancelled",
                           self.route, self.relay.timeout_s)
            if self.status is None:
                await self.relay.timed_out().send(send)
            # else: the response is left unfinished, so the server closes the client's connection (a visible cut)

    async def _answer(self, send: Send) -> None:
        try:
            body = json.loads(self.body)
        except ValueError as error:
            return await error_answer(400, f"malformed JSON: {error}", "invalid_request_error").send(send)
        if not isinstance(body, dict):
            return await error_answer(400, f"the body must be a JSON object, got {type(body).__name__}",
                                      "invalid_request_error").send(send)
        pool = self.relay.pool
        if (role := pool.missing_role()) is not None:
            return await self.relay.unavailable(role).send(send)
        prefill, decode = pool.pick("prefill"), pool.pick("decode")
        try:
            await self._relay(body, prefill, decode, send)
        finally:
            pool.release(prefill)
            pool.release(decode)

    async def _relay(self, body: dict, prefill: Instance, decode: Instance, send: Send) -> None:
        content = json.dumps({**body, "bootstrap_host": prefill.host, "bootstrap_port": prefill.bootstrap_port,
                              "bootstrap_room": random.getrandbits(63)}).encode()
        prefill_task = asyncio.create_task(self._prefill(prefill, self._request(prefill, content)))
        decode_task = asyncio.create_task(self.relay.open(decode, self._request(decode, content)))
        try:
            done, _ = await asyncio.wait({prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED)
            if prefill_task in done and prefill_task.result() is None:
                await asyncio.wait({decode_task})  # the prefill went well; its answer decides nothing more
            plain = body.get("stream") is not True
            # a decode that refuses the request (400 for a prompt its pool cannot hold, say) never bootstraps
            # it: the prefill half is cancelled at once instead of holding its blocks until its bootstrap timeout
            refused = decode_task.done() and decode_task.exception() is None and decode_task.result().status_code >= 400
            if plain and decode_task.done() and decode_task.exception() is None and not refused:
                await asyncio.wait({prefill_task})  # a plain answer is sent whole: a prefill failure still wins
            if prefill_task.done() and (failure := prefill_task.result()) is not None:
                return await failure.send(send)
            try:
                response = decode_task.result()
            except httpx.TransportError as error:
                return await self.relay.unreachable(decode, error).send(send)
            forward = asyncio.create_task(self._forward(response, send))
            watched = {forward} if refused else {forward, prefill_task}
            done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            if forward not in done and (failure := prefill_task.result()) is not None:
                # the prefill half failed after the decode's stream began: that stream would only wait out its
                # timeout; it is cut (the decode side aborts) and the client told in-band, as a server does
                forward.cancel()
                await asyncio.wait({forward})
                await send({"type": "http.response.body", "body": _stream_error(failure), "more_body": True})
            elif not await forward:
                return
            if not refused:
                await prefill_task  # both answers read to the end before the client's ends
            await send({"type": "http.response.body", "body": b""})
        finally:
            prefill_task.cancel()
            decode_task.cancel()
            await asyncio.wait({prefill_task, decode_task})
            if not decode_task.cancelled() and decode_task.exception() is None:
                await decode_task.result().aclose()  # before its end: closes the connection, an abort upstream

    def _request(self, instance: Instance, content: bytes) -> httpx.Request:
        return self.relay.client.build_request("POST", instance.url + self.route, content=content,
                                               headers={**self.headers_out, "content-type": "application/json"})

    async def _prefill(self, prefill: Instance, request: httpx.Request) -> Answer | None:
        """The prefill half, read to the end: its failure as the client would get it, or None."""
        try:
            response = await self.relay.open(prefill, request)
        except httpx.TransportError as error:
            return self.relay.unreachable(prefill, error)
        try:
            body = b"".join([chunk async for chunk in response.aiter_raw()])
        except httpx.TransportError as error:
            logger.warning("the prefill instance %s broke off its answer: %r", prefill.url, error)
            return self.relay.unreachable(prefill, error, mid_answer=True)
        finally:
            await response.aclose()
        if response.status_code < 400:
            return None
        logger.warning("the prefill instance %s answered %d: %s", prefill.url, response.status_code,
                       body[:MAX_LOGGED_BODY_CHARS].decode(errors="replace"))
        return Answer(response.status_code, response_headers(response), body)

    async def _forward(self, response: httpx.Response, send: Send) -> bool:
        """The decode's status, headers and body, chunk by chunk; the closing empty chunk is the
        caller's. False when the decode broke off: the response is left unfinished, so the server
        closes the client's connection (a cut the client sees, not a clean end)."""
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": response_headers(response)})
        try:
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.TransportError as error:
            logger.warning("the decode instance broke off its answer to a %s request: %r", self.route, error)
            return False
        return True


def _stream_error(failure: Answer) -> bytes:
    """The prefill half's error as the last events of an SSE stream (OpenAI's in-band error)."""
    try:
        error = json.loads(failure.body)["error"]
    except (ValueError, KeyError, TypeError):
        error = {"message": failure.body.decode(errors="replace")[:MAX_LOGGED_BODY_CHARS], "type": "upstream_error",
                 "param": None, "code": failure.status}
    return f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()


async def _disconnect(receive: Receive) -> None:
    """Returns once the client has disconnected (the body was read before: nothing else comes)."""
    while (await receive())["type"] != "http.disconnect":
        pass

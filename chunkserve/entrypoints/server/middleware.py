"""ASGI guards in front of every route: an API key, and a cap on the request body size.

Both are plain ASGI (not Starlette's BaseHTTPMiddleware) so streamed responses pass through
untouched and a refused request is answered before its body is parsed.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from chunkserve.entrypoints.server.protocol import error_body

ASGIApp = Callable[[dict, Callable, Callable], Awaitable[None]]
OPEN_PATHS = frozenset({"/health"})


async def send_error(send: Callable, status: int, message: str, error_type: str,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(error_body(message, error_type, status)).encode()
    await send({
        "type": "http.response.start", "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    *(headers or [])],
    })
    await send({"type": "http.response.body", "body": body})


class ApiKeyMiddleware:
    """Every path but /health needs `Authorization: Bearer <key>`."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not secrets.compare_digest(given, self.expected):
            return await send_error(send, 401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                    "authentication_error", [(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Refuse a body over `max_bytes` with 413: by its Content-Length, or while it arrives."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        messages: list[dict[str, Any]] = []
        size = 0
        while True:  # read the whole body first: a chunked upload has no Content-Length
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._refuse(send)
            if not message.get("more_body", False):
                break

        async def replay() -> dict[str, Any]:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Callable) -> None:
        await send_error(send, 413, f"request body is larger than the limit of {self.max_bytes} bytes",
                         "invalid_request_error")

"""ASGI guards in front of every route: API keys (a separate one for admin endpoints), and a
cap on the request body's size and on how long its upload may stall.

All are plain ASGI (not Starlette's BaseHTTPMiddleware) so streamed responses pass through
untouched and a refused request is answered before its body is parsed.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from chunkserve.entrypoints.server.access import Access
from chunkserve.entrypoints.server.protocol import error_body

ASGIApp = Callable[[dict, Callable, Callable], Awaitable[None]]
CLOSE_HEADER = (b"connection", b"close")


async def send_error(send: Callable, status: int, message: str, error_type: str,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(error_body(message, error_type, status)).encode()
    await send({
        "type": "http.response.start", "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    *(headers or [])],
    })
    await send({"type": "http.response.body", "body": body})


def bearer_token(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """The token of the first `Authorization: Bearer <token>` header, or None.

    The scheme is case-insensitive (RFC 7235 §2.1), and clients differ in how they space it.
    """
    for name, value in headers:
        if name == b"authorization":
            parts = value.split(maxsplit=1)
            return parts[1].strip() if len(parts) == 2 and parts[0].lower() == b"bearer" else None
    return None


def route_path(scope: dict) -> str:
    """The path the router matches: uvicorn puts `root_path` in front of it, and an admin path
    that only matched without the prefix would slip past the admin key."""
    path, root = scope["path"], scope.get("root_path", "")
    return (path[len(root):] or "/") if root and path.startswith(root) else path


class ApiKeyMiddleware:
    """`access`: each route's access class (access.py). OPEN paths are open; ADMIN paths need the
    admin key (and answer 404 while there is none); every other path, one without a route
    included, needs the API key when one is set.

    The API key does not open admin paths: it is handed to every client, while the admin
    endpoints act on the whole server (they reset caches, show other users' request traces).
    An empty key counts as no key, as an empty CHUNKSERVE_API_KEY always has.
    """

    def __init__(self, app: ASGIApp, api_key: str | None, admin_api_key: str | None,
                 access: Mapping[str, Access]) -> None:
        self.app = app
        self.access = access
        self.api_key = api_key.encode() if api_key else None
        self.admin_api_key = admin_api_key.encode() if admin_api_key else None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = route_path(scope)
        access = self.access.get(path, Access.KEY)
        if access is Access.OPEN:
            return await self.app(scope, receive, send)
        if access is Access.ADMIN:
            if self.admin_api_key is None:
                return await send_error(send, 404, f"{path} is an admin endpoint, and admin endpoints are disabled: "
                                                   "start the server with --admin-api-key to enable them",
                                        "not_found_error")
            expected, which = self.admin_api_key, "admin API key"
        elif self.api_key is not None:
            expected, which = self.api_key, "API key"
        else:
            return await self.app(scope, receive, send)
        given = bearer_token(scope["headers"])
        # compare_digest takes as long whatever the key's first wrong byte: no timing oracle.
        if given is None or not secrets.compare_digest(given, expected):
            return await send_error(send, 401, f"missing or wrong {which}: send 'Authorization: Bearer <key>'",
                                    "authentication_error", [(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Read the whole body before the route runs, and refuse it with 413 when it is over
    `max_bytes` (by its Content-Length, or while it arrives: a chunked upload has none), or
    with 408 when the whole of it takes over `read_timeout_s` to arrive (a client that stalls
    or trickles would otherwise hold its connection and the route's task forever).

    A client that disconnects mid-upload is nobody's error: the request ends without a
    response or a log line. `unlimited_paths` (admin routes whose bodies are request snapshots,
    tens of MB of KV, behind the admin key) keep the deadline but not the size limit.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout_s: float,
                 unlimited_paths: frozenset[str] = frozenset()) -> None:
        if read_timeout_s <= 0:
            raise ValueError(f"read_timeout_s must be positive, got {read_timeout_s}")
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s
        self.unlimited_paths = unlimited_paths

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        max_bytes = float("inf") if route_path(scope) in self.unlimited_paths else self.max_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            return await self._refuse(send)
        messages: list[dict[str, Any]] = []
        size = 0
        deadline = asyncio.get_running_loop().time() + self.read_timeout_s  # for the whole body: no trickling
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                # Connection: close, or the server would wait on the rest of the body for the next request.
                return await send_error(send, 408, f"the request body did not arrive within "
                                                   f"{self.read_timeout_s:g} s", "timeout_error", [CLOSE_HEADER])
            if message["type"] == "http.disconnect":
                return
            messages.append(message)
            size += len(message.get("body", b""))
            if size > max_bytes:
                return await self._refuse(send)
            if not message.get("more_body", False):
                break

        async def replay() -> dict[str, Any]:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Callable) -> None:
        await send_error(send, 413, f"request body is larger than the limit of {self.max_bytes} bytes",
                         "invalid_request_error")

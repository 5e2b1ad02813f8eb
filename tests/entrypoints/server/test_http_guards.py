"""The server's HTTP guards against clients that stall, drip, abandon or hold connections, and
its keys, over real loopback sockets to uvicorn in a thread: no model, a few seconds.

TIMEOUT_S is both the header and the body-read timeout; a guard is expected to act within
BOUND_S of the moment its deadline started. The guards' timers run on uvicorn's event loop in this
process, which a loaded host delays by tens of milliseconds: BOUND_S leaves 2 s for that, and
the tests that must order events against a deadline do not rely on it (see their comments).
"""

from __future__ import annotations

import asyncio
import json
import logging
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient
from pydantic import BaseModel

from chunkserve.entrypoints.server.access import Access
from chunkserve.entrypoints.server.http_protocol import header_timeout_protocol
from chunkserve.entrypoints.server.middleware import ApiKeyMiddleware, BodySizeLimitMiddleware
from chunkserve.entrypoints.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from chunkserve.entrypoints.server.openapi import document_request_bodies
from chunkserve.entrypoints.server.sglang_protocol import GenerateRequest

TIMEOUT_S = 1.0
BOUND_S = TIMEOUT_S + 2.0  # the guard fired (not "never"), with a margin no loaded host needs
MAX_BODY_BYTES = 4096
API_KEY = "user-key"
ADMIN_KEY = "admin-key"
ACCESS = {"/health": Access.OPEN, "/admin/reset": Access.ADMIN}  # the other routes need the API key
AUTH = {"Authorization": f"Bearer {API_KEY}"}
STREAM_GAP_S = TIMEOUT_S + 0.6  # silence inside a streamed response, longer than every timeout


class RequestLedger:
    """An ASGI wrapper that counts the HTTP requests the app started and ended, so that a test can
    wait for the end of a request whose client has gone instead of sleeping."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.started = 0
        self.ended = 0
        self.changed = threading.Condition()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self._count("started")
        try:
            await self.app(scope, receive, send)
        finally:
            self._count("ended")

    def _count(self, which: str) -> None:
        with self.changed:
            setattr(self, which, getattr(self, which) + 1)
            self.changed.notify_all()

    def wait_until(self, condition: Any, timeout_s: float = 30.0) -> None:
        with self.changed:
            assert self.changed.wait_for(lambda: condition(self), timeout_s), (self.started, self.ended)


def guarded_app(admin_api_key: str | None) -> RequestLedger:
    app = FastAPI()

    @app.post("/echo")
    async def echo(raw: Request):
        return {"received": len(await raw.body())}

    @app.get("/stream")
    async def stream():
        async def chunks():
            yield b"first\n"
            await asyncio.sleep(STREAM_GAP_S)
            yield b"last\n"
        return StreamingResponse(chunks(), media_type="text/plain")

    @app.get("/health")
    async def health():
        return {}

    @app.post("/admin/reset")
    async def admin_reset():
        return {"reset": True}

    app.add_middleware(BodySizeLimitMiddleware, max_bytes=MAX_BODY_BYTES, read_timeout_s=TIMEOUT_S)
    app.add_middleware(ApiKeyMiddleware, api_key=API_KEY, admin_api_key=admin_api_key, access=ACCESS)
    return RequestLedger(app)


class LiveServer:
    """uvicorn with the header-timeout protocol, in a daemon thread on a free loopback port."""

    def __init__(self, app: RequestLedger, timeout_s: float = TIMEOUT_S) -> None:
        self.app = app
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.address = sock.getsockname()
        self.base_url = f"http://127.0.0.1:{self.address[1]}"
        config = uvicorn.Config(app, http=header_timeout_protocol(timeout_s), lifespan="off", log_config=None,
                                log_level="info", access_log=False, timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        assert not self.thread.is_alive(), "uvicorn did not shut down"

    def connect(self) -> socket.socket:
        return socket.create_connection(self.address, timeout=BOUND_S + 2)


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    live = LiveServer(guarded_app(admin_api_key=ADMIN_KEY))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def server_without_admin() -> Iterator[LiveServer]:
    live = LiveServer(guarded_app(admin_api_key=None))
    yield live
    live.stop()


def read_until_closed(sock: socket.socket, started: float, bound_s: float = BOUND_S) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and the seconds from `started` to the close."""
    data = b""
    sock.settimeout(max(0.1, started + bound_s + 2 - time.monotonic()))
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        except TimeoutError:
            raise AssertionError(f"the server kept the connection open; it sent {data!r}") from None
        if not chunk:
            break
        data += chunk
    return data, time.monotonic() - started


def read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """One response with a Content-Length from a connection left open: its head and body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    fields = dict(line.lower().split(b":", 1) for line in head.split(b"\r\n")[1:])
    length = int(fields[b"content-length"])
    while len(body) < length:
        body += sock.recv(65536)
    return head, body


def drip(sock: socket.socket, data: bytes, every_s: float = 0.2) -> None:
    """Send `data` a byte at a time until the server answers or closes the connection."""
    for byte in data:
        if select.select([sock], [], [], every_s)[0]:
            return
        try:
            sock.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            return


def request_head(method: str, path: str, *extra: str) -> bytes:
    return "\r\n".join([f"{method} {path} HTTP/1.1", "Host: test", f"Authorization: Bearer {API_KEY}", *extra,
                        "", ""]).encode()


def error_of(response_bytes: bytes) -> dict[str, Any]:
    return json.loads(response_bytes.partition(b"\r\n\r\n")[2])["error"]


# Slow clients: the connection-level header deadline.

def test_a_request_head_that_stops_halfway_gets_408_and_is_closed(server):
    with server.connect() as sock:
        started = time.monotonic()
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: te")
        data, elapsed = read_until_closed(sock, started)
    assert elapsed < BOUND_S
    assert data.startswith(b"HTTP/1.1 408 ") and b"connection: close" in data.lower()
    assert error_of(data)["type"] == "timeout_error"


def test_a_connection_that_sends_nothing_is_closed_without_a_response(server):
    with server.connect() as sock:
        data, elapsed = read_until_closed(sock, time.monotonic())
    assert data == b"" and elapsed < BOUND_S


def test_a_dripping_head_does_not_extend_its_deadline(server):
    with server.connect() as sock:
        started = time.monotonic()
        drip(sock, request_head("GET", "/health")[:-2])  # a byte per 0.2 s: the head would take 14 s
        data, elapsed = read_until_closed(sock, started)
    assert elapsed < BOUND_S and data.startswith(b"HTTP/1.1 408 ")


def test_a_keep_alive_connection_whose_next_head_stalls_is_closed(server):
    # uvicorn's own keep-alive timeout (5 s) stops counting at the next request's first byte.
    with server.connect() as sock:
        sock.sendall(request_head("GET", "/health"))
        head, body = read_response(sock)
        assert head.startswith(b"HTTP/1.1 200 ") and body == b"{}"
        started = time.monotonic()
        sock.sendall(b"GET /hea")
        data, elapsed = read_until_closed(sock, started)
    assert elapsed < BOUND_S and data.startswith(b"HTTP/1.1 408 ")


# Long enough that no loaded host delays the normal request past it: the test checks an order
# (served before any stalled head timed out), which a too-short deadline would turn into a race.
FIFTY_STALLED_TIMEOUT_S = 3.0


def test_fifty_stalled_heads_are_all_closed_while_normal_requests_are_served():
    live = LiveServer(guarded_app(admin_api_key=None), timeout_s=FIFTY_STALLED_TIMEOUT_S)
    bound_s = FIFTY_STALLED_TIMEOUT_S + 2.0  # the margin of BOUND_S
    started = time.monotonic()
    stalled = [live.connect() for _ in range(50)]
    try:
        for sock in stalled:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\nX-Slow: ")
        response = httpx.get(f"{live.base_url}/health", timeout=bound_s)
        assert response.status_code == 200
        # Not queued behind them: answered while every stalled connection still waits for its deadline.
        assert not select.select(stalled, [], [], 0)[0], "a stalled head was answered before the normal request"
        closes = [read_until_closed(sock, started, bound_s) for sock in stalled]
    finally:
        for sock in stalled:
            sock.close()
        live.stop()
    assert all(data.startswith(b"HTTP/1.1 408 ") for data, _ in closes)
    assert max(elapsed for _, elapsed in closes) < bound_s


def test_a_streamed_response_is_not_cut_by_the_timeouts(server):
    started = time.monotonic()
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=BOUND_S + STREAM_GAP_S) as client:
        with client.stream("GET", "/stream") as response:
            assert b"".join(response.iter_bytes()) == b"first\nlast\n"
        assert time.monotonic() - started > STREAM_GAP_S
        assert client.get("/health").status_code == 200  # the same connection, kept alive after it


def test_graceful_shutdown_lets_a_stream_finish_and_closes_stalled_connections():
    live = LiveServer(guarded_app(admin_api_key=None))
    stalled = live.connect()
    stalled.sendall(b"GET /health HTTP/1.1\r\n")
    with httpx.stream("GET", f"{live.base_url}/stream", headers=AUTH, timeout=BOUND_S + STREAM_GAP_S) as response:
        chunks = response.iter_bytes()
        assert next(chunks) == b"first\n"
        live.server.should_exit = True
        assert b"".join(chunks) == b"last\n"
    live.stop()
    with stalled:
        assert read_until_closed(stalled, time.monotonic())[0] == b""


# Slow and abandoned bodies: BodySizeLimitMiddleware's read timeout.

def test_a_body_that_stalls_gets_408_and_the_connection_is_closed(server):
    with server.connect() as sock:
        sock.sendall(request_head("POST", "/echo", "Content-Length: 100") + b"x" * 10)
        started = time.monotonic()
        data, elapsed = read_until_closed(sock, started)
    assert elapsed < BOUND_S and data.startswith(b"HTTP/1.1 408 ")
    error = error_of(data)
    assert error["type"] == "timeout_error" and error["code"] == 408 and f"{TIMEOUT_S:g} s" in error["message"]


def test_a_body_over_the_limit_still_gets_413(server):
    response = httpx.post(f"{server.base_url}/echo", headers=AUTH, content=b"x" * (MAX_BODY_BYTES + 1))
    assert response.status_code == 413 and response.json()["error"]["type"] == "invalid_request_error"
    assert httpx.post(f"{server.base_url}/echo", headers=AUTH, content=b"x" * 100).json() == {"received": 100}


def test_an_upload_abandoned_midway_logs_nothing_and_the_server_goes_on(server, caplog):
    caplog.set_level(logging.DEBUG)
    ledger = server.app
    started_before = ledger.started
    with server.connect() as sock:
        sock.sendall(request_head("POST", "/echo", "Content-Length: 1000") + b"x" * 10)
        ledger.wait_until(lambda ledger: ledger.started > started_before)  # the route waits on the rest of the body
    # The request ends (the client's disconnect, or at the latest the read timeout) before the
    # check; the next request's answer comes after anything uvicorn logs about the ended one.
    ledger.wait_until(lambda ledger: ledger.ended == ledger.started)
    assert httpx.post(f"{server.base_url}/echo", headers=AUTH, content=b"abc").json() == {"received": 3}
    complaints = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not complaints, [r.getMessage() for r in complaints]


def test_a_connection_answered_before_its_body_is_closed_when_the_body_drips(server):
    # A 401 comes before the upload is read; a client that goes on dripping the body would
    # hold the connection (each byte cancels uvicorn's keep-alive timer).
    with server.connect() as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: test\r\nContent-Length: 1000\r\n\r\n")
        head, _ = read_response(sock)
        assert head.startswith(b"HTTP/1.1 401 ")
        started = time.monotonic()
        drip(sock, b"x" * 1000)
        data, elapsed = read_until_closed(sock, started)
    assert data == b"" and elapsed < BOUND_S


# Keys.

@pytest.mark.parametrize("authorization", [f"Bearer {API_KEY}", f"bearer {API_KEY}", f"BEARER {API_KEY}",
                                           f"Bearer   {API_KEY}", f"Bearer\t{API_KEY}"])
def test_the_bearer_scheme_is_case_insensitive(server, authorization):
    response = httpx.post(f"{server.base_url}/echo", headers={"Authorization": authorization}, content=b"ab")
    assert response.status_code == 200 and response.json() == {"received": 2}


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {API_KEY}"},
                                     {"Authorization": API_KEY}, {"Authorization": f"Bearer {API_KEY}x"}])
def test_a_missing_or_wrong_key_gets_401(server, headers):
    response = httpx.post(f"{server.base_url}/echo", headers=headers, content=b"ab")
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # open to all


@pytest.mark.parametrize("key, status", [(None, 401), ("wrong", 401), (API_KEY, 401), (ADMIN_KEY, 200)])
def test_admin_paths_need_the_admin_key(server, key, status):
    headers = {"Authorization": f"bearer {key}"} if key else {}
    response = httpx.post(f"{server.base_url}/admin/reset", headers=headers)
    assert response.status_code == status
    if status == 401:
        assert response.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("key", [None, API_KEY, ADMIN_KEY])
def test_admin_paths_are_404_without_an_admin_key(server_without_admin, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    response = httpx.post(f"{server_without_admin.base_url}/admin/reset", headers=headers)
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["type"] == "not_found_error" and "--admin-api-key" in error["message"]
    assert httpx.post(f"{server_without_admin.base_url}/echo", headers=AUTH, content=b"a").status_code == 200


# The OpenAPI document.

BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/generate": GenerateRequest}


def hand_parsing_app() -> FastAPI:
    app = FastAPI()
    def parse_into(model: type[BaseModel]):
        async def route(raw: Request):
            return model.model_validate_json(await raw.body()).model_dump()
        return route

    for path, model in BODIES.items():
        app.post(path)(parse_into(model))

    @app.get("/debug/steps")  # FastAPI's own components (a query parameter's 422) stay
    async def steps(last: int = 100):
        return {}
    return app


def resolve(document: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = document
    for part in ref[2:].split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def refs_in(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from refs_in(value)
    elif isinstance(node, list):
        for item in node:
            yield from refs_in(item)


def test_openapi_documents_the_hand_parsed_request_bodies():
    app = hand_parsing_app()
    document_request_bodies(app, BODIES)
    document = TestClient(app).get("/openapi.json").json()
    assert document["openapi"].startswith("3.1")
    for path, model in BODIES.items():
        body = document["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        assert resolve(document, body["content"]["application/json"]["schema"]["$ref"])["title"] == model.__name__
    schemas = document["components"]["schemas"]
    nested = {"ChatMessage", "TextPart", "ImageURLPart", "StreamOptions", "GenerateSamplingParams"}
    assert nested | {"HTTPValidationError"} <= set(schemas)
    refs = list(refs_in(document))
    assert refs and all(resolve(document, ref) for ref in refs)
    assert "$defs" not in json.dumps(document)
    assert app.openapi() is app.openapi()  # built once


def test_openapi_refuses_a_path_without_a_post_route():
    with pytest.raises(ValueError, match="/v1/embeddings"):
        document_request_bodies(hand_parsing_app(), {"/v1/embeddings": CompletionRequest})

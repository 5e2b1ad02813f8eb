"""`chunkserve router --pd-disaggregation` against fake prefill and decode servers.

The fakes are small FastAPI apps that uvicorn runs in threads of this process, so that a test
can read what each received and when it sent each event; the router is the real command line
in a subprocess. A request's `fake_*` fields tell the fakes how to answer.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from chunkserve.bench.service import Service, free_port
from chunkserve.entrypoints.cli import main

INTERVAL_S = 0.2  # the routers' --health-check-interval
MODELS = {"object": "list", "data": [{"id": "fake-model", "object": "model", "owned_by": "test"}]}


def eventually(check: Callable[[], Any], timeout_s: float = 5.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, "the condition was never met"
        time.sleep(0.02)
    return result


def sse_event(index: int) -> bytes:
    return f'data: {{"index": {index}, "text": "token {index}"}}\n\n'.encode()


def sse_stream(count: int) -> bytes:
    return b"".join(sse_event(i) for i in range(count)) + b"data: [DONE]\n\n"


def completion(fake_id: str) -> dict:
    return {"id": fake_id, "object": "text_completion", "choices": [{"index": 0, "text": "ünïcode answer"}]}


def prefill_error(status: int) -> dict:
    return {"error": {"message": "prompt too long", "type": "invalid_request_error", "param": "prompt",
                      "code": status}}


@dataclass
class Fake:
    """A prefill or decode server: `role` is the disaggregation_mode its /server_info reports."""

    role: str
    bootstrap_port: int | None = None
    port: int = field(default_factory=free_port)
    bodies: list[dict] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)
    sent_at: dict[str, list[float]] = field(default_factory=dict)  # fake_id -> when each SSE event was sent
    cancelled: list[str] = field(default_factory=list)  # fake_ids whose client left before the answer's end
    failing_health_checks: int = 0  # how many of the next GET /health get 503
    health_answers: list[int] = field(default_factory=list)  # the status of every GET /health, in order
    server: uvicorn.Server | None = None
    thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def body(self, fake_id: str) -> dict | None:
        return next((body for body in self.bodies if body.get("fake_id") == fake_id), None)

    def start(self) -> Fake:
        config = uvicorn.Config(fake_app(self), host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="off", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        eventually(lambda: self.server.started)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def fake_app(fake: Fake) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health():
        if fake.failing_health_checks > 0:
            fake.failing_health_checks -= 1
            fake.health_answers.append(503)
            return Response(status_code=503)
        fake.health_answers.append(200)
        return {}

    @app.get("/server_info")
    async def server_info():
        return {"disaggregation_mode": fake.role, "disaggregation_bootstrap_port": fake.bootstrap_port,
                "model": "fake-model"}

    @app.get("/v1/models")
    async def models():
        return MODELS

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        fake.bodies.append(body)
        fake.authorizations.append(request.headers.get("authorization"))
        if fake.role == "prefill":
            if body.get("fake_prefill_break"):
                return BrokenOff()
            status = body.get("fake_prefill_status", 200)
            return JSONResponse(prefill_error(status) if status >= 400 else {"prefilled": True}, status)
        await asyncio.sleep(body.get("fake_decode_delay", 0))  # holds back the status line
        if await request.is_disconnected():
            fake.cancelled.append(body["fake_id"])
            return Response(status_code=499)
        if not body.get("stream"):
            return JSONResponse(completion(body["fake_id"]), body.get("fake_status", 200))
        return StreamingResponse(events(fake, body), media_type="text/event-stream")

    return app


class BrokenOff(Response):
    """The status line and headers of a 100-byte answer, then the connection dropped, as from a
    process killed mid-answer."""

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"100")]})
        raise ConnectionAbortedError("the fake drops its connection")


async def events(fake: Fake, body: dict):
    times = fake.sent_at.setdefault(body["fake_id"], [])
    finished = False
    try:
        for index in range(body.get("fake_events", 3)):
            if index:
                await asyncio.sleep(body.get("fake_interval", 0.05))
            times.append(time.monotonic())
            yield sse_event(index)
        yield b"data: [DONE]\n\n"
        finished = True
    finally:
        if not finished:
            fake.cancelled.append(body["fake_id"])


@dataclass
class Router:
    service: Service

    @property
    def process(self) -> subprocess.Popen:
        return self.service.popen

    @property
    def url(self) -> str:
        return self.service.url

    def log(self) -> str:
        with open(self.service.log_path) as log:
            return log.read()

    def post(self, fake_id: str, route: str = "/v1/completions", **fields) -> httpx.Response:
        body = {"prompt": "hello", "max_tokens": 8, "fake_id": fake_id, **fields}
        return httpx.post(self.url + route, json=body, headers={"Authorization": "Bearer secret"}, timeout=10)

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", timeout=5)

    def metrics(self) -> dict[str, float]:
        samples = {}
        for family in text_string_to_metric_families(httpx.get(f"{self.url}/metrics", timeout=5).text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}"] = sample.value
        return samples


def start_router(directory, *flags: str) -> Router:
    """The real command line (the harness adds --port); answers /health (200 or 503) when this returns."""
    port = free_port()
    command = [sys.executable, "-m", "chunkserve.entrypoints.cli", "router", "--pd-disaggregation",
               "--health-check-interval", str(INTERVAL_S), *flags]
    router = Router(Service(command, str(directory / f"router-{port}.log"), port=port, log_mode="w"))
    router.service.wait_healthy(timeout_s=30, ready=(200, 503), show_log=True)
    return router


def stop_router(router: Router) -> None:
    """SIGTERM (the router's graceful stop), which must end it cleanly within 15 s."""
    router.service.stop(grace_s=15)
    assert router.process.returncode == 0, router.log()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[tuple[Router, list[Fake], list[Fake]]]:
    """Two prefill instances (the first with its bootstrap port given on the command line,
    overriding the one it reports), two decode instances, one router."""
    prefills = [Fake("prefill", bootstrap_port=7001).start(), Fake("prefill", bootstrap_port=7002).start()]
    decodes = [Fake("decode").start(), Fake("decode").start()]
    router = start_router(tmp_path_factory.mktemp("router"), "--prefill", prefills[0].url, "8998",
                          "--prefill", prefills[1].url, "--decode", decodes[0].url, "--decode", decodes[1].url)
    eventually(lambda: router.health().status_code == 200)
    yield router, prefills, decodes
    stop_router(router)
    for fake in prefills + decodes:
        fake.stop()


@pytest.fixture
def pair(tmp_path) -> Iterator[tuple[Fake, Fake]]:
    """One prefill and one decode instance of a test's own, for tests that stop them."""
    prefill, decode = Fake("prefill", bootstrap_port=7003).start(), Fake("decode").start()
    yield prefill, decode
    for fake in (prefill, decode):
        if fake.server.started and not fake.server.should_exit:
            fake.stop()


def new_id() -> str:
    return uuid.uuid4().hex


def test_bootstrap_fields_are_added_and_equal_on_both_sides(cluster):
    router, prefills, decodes = cluster
    rooms = []
    for route in ("/v1/completions", "/v1/chat/completions", "/generate"):
        fake_id = new_id()
        assert router.post(fake_id, route).status_code == 200
        [(prefill, sent_to_prefill)] = [(p, p.body(fake_id)) for p in prefills if p.body(fake_id)]
        [sent_to_decode] = [d.body(fake_id) for d in decodes if d.body(fake_id)]
        assert sent_to_prefill == sent_to_decode
        assert sent_to_decode["bootstrap_host"] == "127.0.0.1"
        assert sent_to_decode["bootstrap_port"] == (8998 if prefill is prefills[0] else 7002)
        assert 0 <= sent_to_decode["bootstrap_room"] < 2**63
        assert {k: v for k, v in sent_to_decode.items() if not k.startswith("bootstrap_")} == {
            "prompt": "hello", "max_tokens": 8, "fake_id": fake_id}
        rooms.append(sent_to_decode["bootstrap_room"])
    assert len(set(rooms)) == 3
    assert {*prefills[0].authorizations, *decodes[0].authorizations} == {"Bearer secret"}


def test_a_stream_reaches_the_client_byte_identical_and_as_it_comes(cluster):
    router, _, decodes = cluster
    fake_id = new_id()
    body = {"prompt": "hi", "stream": True, "fake_id": fake_id, "fake_events": 5, "fake_interval": 0.15}
    received, first_chunk_at = b"", None
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=10) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for chunk in response.iter_raw():
            first_chunk_at = first_chunk_at or time.monotonic()
            received += chunk
    assert received == sse_stream(5)
    [sent_at] = [d.sent_at[fake_id] for d in decodes if fake_id in d.sent_at]
    assert first_chunk_at < sent_at[-1], "the first event came only after the upstream sent its last"


def test_a_plain_answer_passes_through_with_its_status(cluster):
    router, _, _ = cluster
    fake_id = new_id()
    response = router.post(fake_id, fake_status=207)
    assert response.status_code == 207
    assert response.headers["content-type"] == "application/json"
    assert response.content == JSONResponse(completion(fake_id)).body


@pytest.mark.parametrize("stream", [False, True])
def test_a_prefill_error_is_what_the_client_gets(cluster, stream):
    router, _, decodes = cluster
    fake_id = new_id()
    # The decode's status line comes late, as a real decode waits for the KV that never comes.
    response = router.post(fake_id, stream=stream, fake_prefill_status=422, fake_decode_delay=0.5)
    assert response.status_code == 422
    assert response.json() == prefill_error(422)
    eventually(lambda: any(fake_id in d.cancelled for d in decodes))
    assert "answered 422" in router.log()


def test_requests_are_spread_over_the_instances(cluster):
    router, prefills, decodes = cluster
    ids = [new_id() for _ in range(8)]
    for fake_id in ids:  # one at a time: nothing in flight, so round-robin
        assert router.post(fake_id).status_code == 200
    assert [sum(f.body(i) is not None for i in ids) for f in prefills + decodes] == [4, 4, 4, 4]
    ids = [new_id() for _ in range(4)]
    with ThreadPoolExecutor(4) as pool:  # together: the fewest requests in flight
        statuses = list(pool.map(lambda i: router.post(i, stream=True, fake_events=4, fake_interval=0.2).status_code,
                                 ids))
    assert statuses == [200] * 4
    assert [sum(f.body(i) is not None for i in ids) for f in prefills + decodes] == [2, 2, 2, 2]


def test_a_client_that_leaves_cancels_the_decode_request(cluster):
    router, _, decodes = cluster
    fake_id = new_id()
    body = {"prompt": "hi", "stream": True, "fake_id": fake_id, "fake_events": 50, "fake_interval": 0.05}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=10) as response:
        next(response.iter_raw())
    eventually(lambda: any(fake_id in d.cancelled for d in decodes), timeout_s=3)
    assert max(len(d.sent_at.get(fake_id, [])) for d in decodes) < 50


def test_models_and_bad_bodies(cluster):
    router, _, _ = cluster
    assert httpx.get(f"{router.url}/v1/models").json() == MODELS
    for content in (b"{not json", b"[1, 2]"):
        response = httpx.post(f"{router.url}/v1/completions", content=content)
        assert response.status_code == 400
        assert response.json()["error"]["type"] == "invalid_request_error"


def test_metrics_count_requests_and_show_the_instances(cluster):
    router, prefills, decodes = cluster
    assert router.post(new_id()).status_code == 200
    metrics = router.metrics()
    assert metrics["chunkserve:router_requests_total{route=/v1/completions,status=200}"] >= 1
    assert metrics["chunkserve:router_request_duration_seconds_count{route=/v1/completions}"] >= 1
    for role, fakes in (("prefill", prefills), ("decode", decodes)):
        for fake in fakes:
            labels = f"instance={fake.url},role={role}"
            assert metrics[f"chunkserve:router_upstream_requests_total{{{labels},status=200}}"] >= 1
            assert metrics[f"chunkserve:router_instance_healthy{{{labels}}}"] == 1
            assert metrics[f"chunkserve:router_requests_in_flight{{{labels}}}"] == 0


def assert_unavailable(response: httpx.Response, message: str) -> None:
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    error = response.json()["error"]
    assert error["type"] == "service_unavailable" and message in error["message"], error


def fail_health_checks(fake: Fake, count: int) -> None:
    """Make `fake` answer its next `count` health checks 503; returns once it has answered them
    and a good one after them, by when the router has acted on all of them (it checks an
    instance again only after it has handled the previous check)."""
    answered = len(fake.health_answers)
    fake.failing_health_checks = count

    def failed_then_answered() -> bool:
        answers = fake.health_answers[answered:]
        return 503 in answers and answers[answers.index(503):][:count + 1] == [503] * count + [200]

    eventually(failed_then_answered, timeout_s=30)


def test_a_role_down_is_503_until_it_is_back(pair, tmp_path):
    prefill, decode = pair
    router = start_router(tmp_path, "--prefill", prefill.url, "--decode", decode.url,
                          "--health-failure-threshold", "2")
    out_of_rotation = f"decode instance {decode.url} is out of rotation: /health answered 503"
    healthy_key = f"chunkserve:router_instance_healthy{{instance={decode.url},role=decode}}"
    try:
        eventually(lambda: router.health().status_code == 200)
        assert router.post(new_id()).status_code == 200
        # The threshold counts checks, not seconds: one failed check leaves the instance in rotation,
        # two in a row take it out, and the next good check brings it back.
        fail_health_checks(decode, 1)
        assert out_of_rotation not in router.log() and router.metrics()[healthy_key] == 1
        fail_health_checks(decode, 2)
        assert router.log().count(out_of_rotation) == 1
        eventually(lambda: router.health().status_code == 200)
        decode.stop()
        eventually(lambda: router.health().status_code == 503, timeout_s=30)
        assert_unavailable(router.health(), "no healthy decode instance")
        assert_unavailable(router.post(new_id()), "no healthy decode instance")
        decode.start()
        eventually(lambda: router.health().status_code == 200)
        assert router.post(new_id()).status_code == 200
    finally:
        stop_router(router)


def test_an_unreachable_instance_is_taken_out_at_once(pair, tmp_path):
    prefill, decode = pair
    router = start_router(tmp_path, "--prefill", prefill.url, "--decode", decode.url,
                          "--health-failure-threshold", "1000")  # the health checks would take minutes
    try:
        eventually(lambda: router.health().status_code == 200)
        decode.stop()
        assert_unavailable(router.post(new_id()), "could not be reached")
        assert_unavailable(router.health(), "no healthy decode instance")
        decode.start()
        eventually(lambda: router.health().status_code == 200)  # one good check is enough
        assert router.post(new_id()).status_code == 200
    finally:
        stop_router(router)


def test_a_prefill_that_drops_its_connection_mid_answer_is_lost_to_the_client_and_the_rotation(pair, tmp_path):
    prefill, decode = pair
    router = start_router(tmp_path, "--prefill", prefill.url, "--decode", decode.url,
                          "--health-failure-threshold", "1000")  # only the broken answer takes it out
    try:
        eventually(lambda: router.health().status_code == 200)
        assert_unavailable(router.post(new_id(), fake_prefill_break=True, fake_decode_delay=0.5),
                           f"the prefill instance {prefill.url} was lost mid-answer")
        assert f"prefill instance {prefill.url} is out of rotation: unreachable" in router.log()
        eventually(lambda: router.health().status_code == 200)  # its next good check brings it back
        assert router.post(new_id()).status_code == 200
    finally:
        stop_router(router)


def test_a_request_past_the_timeout_is_504(pair, tmp_path):
    prefill, decode = pair
    router = start_router(tmp_path, "--prefill", prefill.url, "--decode", decode.url, "--request-timeout", "0.5")
    try:
        eventually(lambda: router.health().status_code == 200)
        response = router.post(new_id(), fake_decode_delay=3)
        assert response.status_code == 504 and response.json()["error"]["type"] == "timeout"
    finally:
        stop_router(router)


def test_an_instance_of_the_wrong_role_is_unhealthy(cluster, tmp_path):
    _, _, decodes = cluster
    router = start_router(tmp_path, "--prefill", decodes[0].url, "--decode", decodes[1].url)
    try:
        eventually(lambda: "disaggregation_mode='decode' but it was given as --prefill" in router.log())
        eventually(lambda: router.metrics()[
            f"chunkserve:router_instance_healthy{{instance={decodes[1].url},role=decode}}"] == 1)
        assert_unavailable(router.health(), "no healthy prefill instance")
        assert_unavailable(router.post(new_id()), "no healthy prefill instance")
    finally:
        stop_router(router)


@pytest.mark.parametrize("flags, message", [
    (["--prefill", "http://127.0.0.1:30000"], "no decode instance"),
    (["--decode", "http://127.0.0.1:30001"], "no prefill instance"),
    (["--prefill", "127.0.0.1:30000", "--decode", "http://127.0.0.1:30001"], "not a server's base URL"),
    (["--prefill", "http://127.0.0.1:30000", "--decode", "http://127.0.0.1:30001/v1"], "give no path"),
    (["--prefill", "http://127.0.0.1:30000", "8998", "1", "--decode", "http://h:1"], "got 3 values"),
    (["--prefill", "http://127.0.0.1:30000", "port", "--decode", "http://h:1"], "bootstrap port must be"),
    (["--prefill", "http://h:1", "--decode", "http://h:2", "--decode", "http://h:2"], "given twice"),
])
def test_a_bad_command_line_is_a_clear_error(capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        main(["router", "--pd-disaggregation", *flags])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and message in error, error


def test_the_mode_flag_is_required(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["router", "--prefill", "http://h:1", "--decode", "http://h:2"])
    assert exit_info.value.code == 2
    assert "--pd-disaggregation is required" in capsys.readouterr().err


def test_the_router_loads_no_torch_nor_the_engine():
    code = ("import sys, chunkserve.entrypoints.router.app; "
            "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('chunkserve.engine', "
            "'chunkserve.worker', 'chunkserve.model', 'chunkserve.core'))); print(heavy); assert not heavy")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr

"""The server's life on servers of their own, on the tiny model: overload (503 with Retry-After)
and a clean SIGTERM (one running request at a time, at most one waiting), and an engine core
killed under load: the server exits 1 at once, or with --restart-engine-on-failure serves again.

The servers that must be busy when the signal or the kill arrives run with the test step delay:
a 400-token stream then lasts 400 x STEP_DELAY_MS (16 s), far longer than the action it
outlasts, and each test asserts the request was still running when it acted."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from chunkserve.engine.core import TEST_STEP_DELAY_ENV
from tests.server_process import start_server, stop_server
from tests.tiny_model import STEP_DELAY_MS, TINY_SERVER_ENV, tiny_server_flags

LONG = {"prompt": "Tell me a story.", "max_tokens": 400, "ignore_eos": True, "stream": True}
DELAYED_ENV = {**TINY_SERVER_ENV, TEST_STEP_DELAY_ENV: str(STEP_DELAY_MS)}


@pytest.fixture
def small_server(tmp_path_factory, tiny_gguf):
    server = start_server(tmp_path_factory, *tiny_server_flags(tiny_gguf), "--max-num-seqs", "1",
                          "--max-waiting-requests", "1", "--shutdown-timeout", "2", name="small-server",
                          env=DELAYED_ENV)
    yield server
    stop_server(server)


def stream_in_background(server, received: list[str]) -> threading.Thread:
    """Start a long streaming request; `received` gets its data lines as they come."""

    def run() -> None:
        with server.client() as http, http.stream("POST", "/v1/completions", json=LONG) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    received.append(line)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_overload_gets_503_and_sigterm_exits_cleanly(small_server):
    running, waiting = [], []
    threads = [stream_in_background(small_server, running)]
    small_server.wait_until(lambda m: m["chunkserve:num_requests_running{}"] == 1)
    threads.append(stream_in_background(small_server, waiting))
    small_server.wait_until(lambda m: m["chunkserve:num_requests_waiting{}"] == 1)

    with small_server.client() as http:
        refused = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
    assert refused.json()["error"]["type"] == "server_overloaded"

    # what the shutdown must deal with: a request still running (mid-stream) and one still waiting
    busy = small_server.metrics()
    assert (busy["chunkserve:num_requests_running{}"], busy["chunkserve:num_requests_waiting{}"]) == (1, 1)
    assert "data: [DONE]" not in running + waiting
    small_server.process.send_signal(signal.SIGTERM)
    assert small_server.process.wait(timeout=60) == 0
    for thread in threads:
        thread.join(timeout=10)
    # Both streams ended properly: the shutdown aborted what the 2 s grace period could not finish
    # (the running stream needs 16 s, the waiting one never ran).
    for events in (running, waiting):
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "abort"
    log = open(small_server.log_path).read()
    assert "Traceback" not in log and "server stopped" in log


def engine_process_of(server) -> int:
    """The pid of the server's engine-core process (its child running the model)."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if parent == server.process.pid:
                children.append(int(entry))
    engines = [pid for pid in children if "spawn" in open(f"/proc/{pid}/cmdline").read()]
    assert len(engines) == 1, children
    return engines[0]


def test_a_dead_engine_fails_its_requests_and_the_server_exits_non_zero(tmp_path_factory, tiny_gguf):
    server = start_server(tmp_path_factory, *tiny_server_flags(tiny_gguf), "--shutdown-timeout", "2",
                          name="dying-server", env=DELAYED_ENV)
    try:
        received: list[str] = []
        thread = stream_in_background(server, received)
        server.wait_until(lambda m: m["chunkserve:num_requests_running{}"] == 1)  # 16 s of decoding left
        os.kill(engine_process_of(server), signal.SIGKILL)
        started = time.monotonic()
        assert server.process.wait(timeout=30) == 1
        assert time.monotonic() - started < 15
        thread.join(10)
        assert any('"error"' in line for line in received) and received[-1] == "data: [DONE]"
        log = open(server.log_path).read()
        assert "the engine core died" in log and "--restart-engine-on-failure" in log
    finally:
        stop_server(server)


@pytest.mark.slow
def test_with_restart_on_failure_a_new_engine_serves_after_503s(tmp_path_factory, tiny_gguf):
    server = start_server(tmp_path_factory, *tiny_server_flags(tiny_gguf), "--restart-engine-on-failure",
                          name="restarting-server", env=TINY_SERVER_ENV)
    try:
        os.kill(engine_process_of(server), signal.SIGKILL)
        with server.client() as http:
            deadline = time.monotonic() + 20
            while (refused := http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})).status_code == 200:
                assert time.monotonic() < deadline, "the dead engine was never noticed"
                time.sleep(0.05)
            assert refused.status_code == 503 and refused.headers["Retry-After"] == "10"
            deadline = time.monotonic() + 120
            while http.get("/health").status_code != 200:
                assert time.monotonic() < deadline, "the engine core never came back"
                assert server.process.poll() is None
                time.sleep(0.25)
            for _ in range(3):  # and goes on serving: the new core's counters start at 0 again
                served = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 2
            assert server.metrics()["chunkserve:generation_tokens_total{}"] >= 6
        log = open(server.log_path).read()
        assert log.count("starting a new one") == 1 and "the new engine core is serving" in log
        assert "Traceback" not in log.split("the new engine core is serving", 1)[1]
    finally:
        stop_server(server)

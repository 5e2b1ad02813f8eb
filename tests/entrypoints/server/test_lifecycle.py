"""Overload (503 with Retry-After) and a clean SIGTERM, on a server of their own: one
running request at a time, at most one waiting."""

from __future__ import annotations

import json
import signal
import threading

import pytest

from tests.server_process import start_server, stop_server

LONG = {"prompt": "Tell me a story.", "max_tokens": 400, "ignore_eos": True, "stream": True}


@pytest.fixture
def small_server(tmp_path_factory):
    server = start_server(tmp_path_factory, "--max-num-seqs", "1", "--max-waiting-requests", "1",
                          "--shutdown-timeout", "2", name="small-server")
    yield server
    stop_server(server)


def stream_in_background(server, received: list[str]) -> threading.Thread:
    """Start a long streaming request; `received` gets its data lines as they come."""

    def run() -> None:
        with server.client() as http, http.stream("POST", "/v1/completions", json=LONG) as response:
            received.extend(line for line in response.iter_lines() if line.startswith("data: "))

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

    small_server.process.send_signal(signal.SIGTERM)
    assert small_server.process.wait(timeout=60) == 0
    for thread in threads:
        thread.join(timeout=10)
    # Both streams ended properly: the shutdown aborted what the grace period did not finish.
    for events in (running, waiting):
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("length", "abort")
    log = open(small_server.log_path).read()
    assert "Traceback" not in log and "server stopped" in log

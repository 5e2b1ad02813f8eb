"""A server process for the benchmark scripts that start their own: on a free port of
127.0.0.1, in its own process group (so its children end with it), optionally pinned to CPUs,
with the environment the benchmark gives it."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

SERVER_START_TIMEOUT_S = 300
STOP_TIMEOUT_S = 60
HEALTH_POLL_S = 0.2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(*flags: str) -> list[str]:
    """`chunkserve serve` on 127.0.0.1 with this interpreter; Service adds --port."""
    return [sys.executable, "-m", "chunkserve.entrypoints.cli", "serve", "--host", "127.0.0.1", *flags]


class Service:
    """`command` (given --port) writing to `log_path`, with `env` as its whole environment (default:
    this process's), pinned to `cpus` ("0", "0-1") when given, run in `cwd` (`python -m` imports
    from there first). `new_session`: in a session of its own, as a service started apart would
    be (Linux then schedules it in an autogroup of its own, sharing the CPUs fairly with other
    sessions' groups), else in this process's session and autogroup."""

    def __init__(self, command: list[str], log_path: str, cpus: str | None = None,
                 env: dict[str, str] | None = None, cwd: str | None = None, new_session: bool = True) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        command = [*command, "--port", str(self.port)]
        preexec: Callable[[], None] | None = None
        if cpus is not None and shutil.which("taskset"):
            command = ["taskset", "-c", cpus, *command]
        elif cpus is not None:  # the same pinning, done by the child before it runs the command
            first, _, last = cpus.partition("-")
            preexec = functools.partial(os.sched_setaffinity, 0, set(range(int(first), int(last or first) + 1)))
        with open(log_path, "a") as log:
            self.popen = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                          env=dict(os.environ) if env is None else env,
                                          preexec_fn=preexec, cwd=cwd, start_new_session=new_session,
                                          process_group=None if new_session else 0)

    def stop(self) -> None:
        """SIGTERM (a graceful shutdown), then SIGKILL to whatever of its group is left."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait()

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.popen.args} exited with {self.popen.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(HEALTH_POLL_S)
        raise RuntimeError(f"{self.popen.args} was not healthy within {SERVER_START_TIMEOUT_S} s; see {self.log_path}")

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, summed over its labels."""
        samples: dict[str, float] = {}
        for family in text_string_to_metric_families(httpx.get(f"{self.url}/metrics", timeout=30).text):
            for sample in family.samples:
                samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
        return samples

"""The server harness: start a server command in a process group of its own, wait for its
/health, read its /metrics and step records, stop the whole group, pick free ports.

`chunkserve bench sweep`, every script in benchmarks/ that starts a server and the tests'
tests/server_process.py use it; nothing else in the repository starts a server or picks a port.

A `Service` is `command` on 127.0.0.1: with `{port}` in one of its arguments the port is
substituted there (a peer's start script: `start_vllm.sh {port}`), otherwise `--port PORT` is
appended (`chunkserve serve`, `chunkserve router`) unless `add_port_flag` is false. It writes
to `log_path`, runs with `env` as its whole environment (default: this process's), optionally
pinned to CPUs, in a session (or process group) of its own, so that a stop reaches its children
too (the engine core, rank processes, a start script's server). Every service not yet stopped is stopped when this process
exits (`stop_all`, registered with atexit), so a benchmark that fails leaves no server behind.
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable

import httpx
from prometheus_client.parser import text_string_to_metric_families

SERVER_START_TIMEOUT_S = 300
STOP_TIMEOUT_S = 60  # SIGTERM's grace before SIGKILL
PORT_FREE_TIMEOUT_S = 60
HEALTH_POLL_S = 0.2
LOG_TAIL_CHARS = 4000
STEPS_FETCHED = 50_000  # /debug/steps?last=: more than a benchmark server's whole life


def free_port() -> int:
    """A port of 127.0.0.1 that nothing listens on now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    """Nothing listens on `port` of 127.0.0.1 (SO_REUSEADDR: a closed server's TIME_WAIT
    connections don't count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def serve_command(*flags: str) -> list[str]:
    """`chunkserve serve` on 127.0.0.1 with this interpreter; Service adds --port."""
    return [sys.executable, "-m", "chunkserve.entrypoints.cli", "serve", "--host", "127.0.0.1", *flags]


def log_tail(log_path: str, chars: int = LOG_TAIL_CHARS) -> str:
    """The last `chars` characters of a log file ("" if there is none)."""
    try:
        with open(log_path, errors="replace") as log:
            return log.read()[-chars:]
    except OSError:
        return ""


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float, log_path: str | None = None,
                 ready: Iterable[int] = (200,), name: str = "the server", show_log: bool = False) -> float:
    """Seconds until GET `url`/health answered one of the `ready` statuses. Raises RuntimeError
    if `process` exits first or `timeout_s` passes, naming `log_path` (`show_log`: with its end)."""
    ready = tuple(ready)
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode} while starting"
                               + _log_excerpt(log_path, show_log))
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code in ready:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        time.sleep(HEALTH_POLL_S)
    raise RuntimeError(f"{name} at {url} was not healthy within {timeout_s:.0f} s"
                       + _log_excerpt(log_path, show_log))


def _log_excerpt(log_path: str | None, show: bool) -> str:
    if log_path is None:
        return ""
    return f"; the end of {log_path}:\n{log_tail(log_path)}" if show else f"; see {log_path}"


def stop_process_group(process: subprocess.Popen, grace_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM to `process`'s group (a graceful shutdown: a chunkserve server drains, a
    write-back KV tier flushes), SIGKILL to whatever of it is left after `grace_s` (at once
    with `grace_s` 0), then wait for `process`. Its group must be its own (start_new_session
    or process_group=0)."""
    if process.poll() is None and grace_s > 0:
        _signal_group(process, signal.SIGTERM)
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(process, signal.SIGKILL)  # children that outlived the leader too
    process.wait()


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def metric_samples(url: str, headers: dict[str, str] | None = None) -> list:
    """Every sample of GET `url`/metrics (prometheus_client's Sample: name, labels, value)."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=30).text
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


class Service:
    """`command` (see the module docstring for the port) writing to `log_path` (appended to, or
    `log_mode` "w"), with `env` as its whole environment (default: this process's), pinned to
    `cpus` ("0", "0-1") when given, run in `cwd` (`python -m` imports from there first), on
    `port` (default: a free one). `new_session`: in a session of its own, as a service started
    apart would be (Linux then schedules it in an autogroup of its own, sharing the CPUs fairly
    with other sessions' groups), else in a process group of its own in this process's session
    and autogroup. `label`: the log gets a line `===== label: command` first, with each of
    `hide` (secrets on the command line) written as `***`."""

    def __init__(self, command: list[str], log_path: str, cpus: str | None = None,
                 env: dict[str, str] | None = None, cwd: str | None = None, new_session: bool = True, *,
                 port: int | None = None, add_port_flag: bool = True, log_mode: str = "a",
                 label: str | None = None, hide: Iterable[str] = (),
                 start_timeout_s: float = SERVER_START_TIMEOUT_S) -> None:
        self.port = free_port() if port is None else port
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.label = label
        self.start_timeout_s = start_timeout_s
        if any("{port}" in part for part in command):
            command = [part.replace("{port}", str(self.port)) for part in command]
        elif add_port_flag:
            command = [*command, "--port", str(self.port)]
        self.command = command
        preexec: Callable[[], None] | None = None
        if cpus is not None and shutil.which("taskset"):
            command = ["taskset", "-c", cpus, *command]
        elif cpus is not None:  # the same pinning, done by the child before it runs the command
            first, _, last = cpus.partition("-")
            preexec = functools.partial(os.sched_setaffinity, 0, set(range(int(first), int(last or first) + 1)))
        with open(log_path, log_mode) as log:
            if label is not None:
                shown = " ".join(command)
                for secret in hide:
                    shown = shown.replace(secret, "***")
                log.write(f"\n===== {label}: {shown}\n")
                log.flush()
            self.popen = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                          env=dict(os.environ) if env is None else env,
                                          preexec_fn=preexec, cwd=cwd, start_new_session=new_session,
                                          process_group=None if new_session else 0)
        _RUNNING.append(self)

    @property
    def name(self) -> str:
        return self.label or os.path.basename(self.command[0])

    def __enter__(self) -> Service:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_healthy(self, timeout_s: float | None = None, ready: Iterable[int] = (200,),
                     show_log: bool = False) -> float:
        """Seconds until /health answered one of `ready` (a router answers 503 until it has seen
        its instances); RuntimeError naming the log (`show_log`: with its end) if the process
        exits first or the timeout (default: the service's start timeout) passes."""
        return wait_healthy(self.url, self.popen, self.start_timeout_s if timeout_s is None else timeout_s,
                            self.log_path, ready, self.name, show_log)

    def metrics(self, headers: dict[str, str] | None = None) -> dict[str, float]:
        """Every sample of /metrics, summed over its labels."""
        samples: dict[str, float] = {}
        for sample in metric_samples(self.url, headers):
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value
        return samples

    def steps(self, admin_key: str | None = None, last: int = STEPS_FETCHED) -> list[dict]:
        """The server's latest step records (GET /debug/steps, an admin route: `admin_key` when
        the server has one), oldest first."""
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else None
        response = httpx.get(f"{self.url}/debug/steps", params={"last": last}, headers=headers, timeout=120)
        response.raise_for_status()
        return response.json()["steps"]

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        return log_tail(self.log_path, chars)

    def stop(self, grace_s: float = STOP_TIMEOUT_S, wait_port: bool = False) -> None:
        """Stop the whole group (`stop_process_group`). `wait_port`: then wait until every
        process of the group is gone and nothing listens on the port (the next server of a
        measurement must not share the CPUs with this one's last moments)."""
        try:
            stop_process_group(self.popen, grace_s)
            if wait_port:
                self._wait_gone()
        finally:
            if self in _RUNNING:
                _RUNNING.remove(self)

    def _wait_gone(self) -> None:
        deadline = time.monotonic() + PORT_FREE_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                os.killpg(self.popen.pid, 0)  # a member of the group still running (or not yet reaped)
            except ProcessLookupError:
                if port_is_free(self.port):
                    return
            time.sleep(0.2)
        print(f"warning: {self.name}: port {self.port} or process group {self.popen.pid} still busy",
              file=sys.stderr)


_RUNNING: list[Service] = []  # every service started and not yet stopped


def stop_all(grace_s: float = STOP_TIMEOUT_S) -> None:
    """Stop every service not yet stopped, the latest first."""
    for service in reversed(list(_RUNNING)):
        service.stop(grace_s)


atexit.register(stop_all)

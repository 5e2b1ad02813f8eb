"""The real server in a subprocess on a free port (the `server` fixture in conftest.py), started,
waited for and stopped by the benchmarks' server harness (chunkserve/bench/service.py); what is
here is the tests' view of it: clients with the test keys, labelled metrics, waiting on them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from chunkserve.bench.service import Service, free_port, port_is_free, wait_healthy

__all__ = ["ADMIN_API_KEY", "API_KEY", "Server", "free_port", "port_is_free", "start_command", "start_server",
           "stop_server", "wait_until_up"]

START_TIMEOUT_S = 180
API_KEY = "test-key"
ADMIN_API_KEY = "test-admin-key"
MAX_BODY_BYTES = 256 * 1024


@dataclass
class Server:
    process: subprocess.Popen
    base_url: str
    log_path: str
    trace_path: str | None = None  # the --trace-steps file, when the server writes one
    service: Service | None = None  # the harness's handle, when the harness started it (not a torchrun launch)

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120,
                            **kwargs)

    def admin_client(self, **kwargs) -> httpx.Client:
        """For the admin endpoints (/reset_prefix_cache, /debug/...)."""
        return httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {ADMIN_API_KEY}"}, timeout=120,
                            **kwargs)

    def check(self) -> dict:
        """The engine's self-check (GET /debug/check)."""
        with self.admin_client() as http:
            return http.get("/debug/check").json()

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, keyed by name and sorted labels (without model_name and engine,
        which every chunkserve: sample carries)."""
        text = httpx.get(f"{self.base_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                                  if k not in ("model_name", "engine"))
                samples[f"{sample.name}{{{labels}}}"] = sample.value
        return samples

    def wait_until(self, condition, timeout_s: float = 30.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout_s
        while True:
            metrics = self.metrics()
            if condition(metrics):
                return metrics
            if time.monotonic() > deadline:
                raise AssertionError(f"metrics never met the condition: {metrics}")
            time.sleep(0.05)


def start_server(tmp_path_factory, *flags: str, name: str, env: dict[str, str] | None = None,
                 wait: bool = True) -> Server:
    """`env`: added to the server's environment; `wait=False` returns at once (then `wait_until_up`).
    Servers run in float32, the exact mode whose tokens the tests compare across configurations
    (`--dtype auto`, the default, is bfloat16 on a CPU that has it); a later `--dtype` in
    `flags` wins."""
    command = [sys.executable, "-m", "chunkserve.entrypoints.cli", "serve", "--api-key", API_KEY,
               "--admin-api-key", ADMIN_API_KEY,
               "--kv-cache-memory-gb", "0.25", "--max-request-body-bytes", str(MAX_BODY_BYTES), "--dtype", "float32",
               *flags]
    env = {**os.environ, "CHUNKSERVE_API_KEY": "", "CHUNKSERVE_ADMIN_API_KEY": "", **(env or {})}
    return start_command(tmp_path_factory, command, name=name, env=env, wait=wait)


def start_command(tmp_path_factory, command: list[str], name: str, env: dict[str, str] | None = None,
                  wait: bool = True) -> Server:
    """Any server command (the harness adds --port) with `env` as its whole environment (default:
    this process's), logging to a folder of its own; `wait=False` returns at once."""
    log_path = str(tmp_path_factory.mktemp(name) / "server.log")
    service = Service(command, log_path, env=env, log_mode="w")
    server = Server(service.popen, service.url, log_path, service=service)
    return wait_until_up(server) if wait else server


def wait_until_up(server: Server) -> Server:
    """The server once its /health answers 200; a start that fails or hangs fails with its log."""
    try:
        wait_healthy(server.base_url, server.process, START_TIMEOUT_S, server.log_path, show_log=True)
    except RuntimeError:
        stop_server(server)
        raise
    return server


def stop_server(server: Server) -> None:
    """At once (SIGKILL): a test server has nothing to flush. The whole process group, when the
    harness started it."""
    if server.service is not None:
        server.service.stop(grace_s=0)
    elif server.process.poll() is None:
        server.process.kill()
        server.process.wait()

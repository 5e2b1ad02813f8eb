"""The real server in a subprocess on a free port (the `server` fixture in conftest.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "test-key"
ADMIN_API_KEY = "test-admin-key"
MAX_BODY_BYTES = 256 * 1024


@dataclass
class Server:
    process: subprocess.Popen
    base_url: str
    log_path: str
    trace_path: str | None = None  # the --trace-steps file, when the server writes one

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp_path_factory, *flags: str, name: str, env: dict[str, str] | None = None,
                 wait: bool = True) -> Server:
    """`env`: added to the server's environment; `wait=False` returns at once (then `wait_until_up`).
    Servers run in float32, the exact mode whose tokens the tests compare across configurations
    (`--dtype auto`, the default, is bfloat16 on a CPU that has it); a later `--dtype` in
    `flags` wins."""
    port = free_port()
    log_path = str(tmp_path_factory.mktemp(name) / "server.log")
    env = {**os.environ, "CHUNKSERVE_API_KEY": "", "CHUNKSERVE_ADMIN_API_KEY": "", **(env or {})}
    command = [sys.executable, "-m", "chunkserve.entrypoints.cli", "serve", "--port", str(port), "--api-key", API_KEY,
               "--admin-api-key", ADMIN_API_KEY,
               "--kv-cache-memory-gb", "0.25", "--max-request-body-bytes", str(MAX_BODY_BYTES), "--dtype", "float32",
               *flags]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(process, f"http://127.0.0.1:{port}", log_path)
    return wait_until_up(server) if wait else server


def wait_until_up(server: Server) -> Server:
    process, log_path = server.process, server.log_path
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{open(log_path).read()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    process.kill()
    raise RuntimeError(f"the server did not come up:\n{open(log_path).read()}")


def stop_server(server: Server) -> None:
    if server.process.poll() is None:
        server.process.kill()
        server.process.wait()

"""SMG (Shepherd Model Gateway, SGLang's router; `pip install 'chunkserve[fleet]'`) in front of
chunkserve servers, for the fleet tests and benchmarks: its command line and the wait until
every worker it was given is registered and ready (its /health answers before that).

SMG polls each worker's load every `LOAD_MONITOR_INTERVAL_S` here (its default, 10 s, is longer
than a test); a worker's load is read from its vLLM-named (or, for a prefill or decode
instance, SGLang-named) gauges: `--metrics-compat` on the servers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import httpx

LOAD_MONITOR_INTERVAL_S = 1
WORKERS_READY_TIMEOUT_S = 120
POLL_S = 0.1


def smg_binary() -> str | None:
    """The `smg` launcher of this interpreter's environment, or on PATH; None if not installed."""
    beside = os.path.join(os.path.dirname(sys.executable), "smg")
    return beside if os.path.exists(beside) else shutil.which("smg")


def smg_command(*flags: str, metrics_port: int, api_key: str | None = None) -> list[str]:
    """`smg launch FLAGS` on 127.0.0.1 (the server harness adds --port), its Prometheus listener on
    `metrics_port`; `api_key` guards its API and is sent to the workers."""
    binary = smg_binary()
    if binary is None:
        raise FileNotFoundError("SMG is not installed: pip install 'chunkserve[fleet]'")
    return [binary, "launch", "--host", "127.0.0.1", *(["--api-key", api_key] if api_key else []),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
            "--load-monitor-interval", str(LOAD_MONITOR_INTERVAL_S), *flags]


def smg_workers(url: str, headers: dict[str, str] | None = None) -> list[dict]:
    """SMG's worker listing: url, worker_type, runtime_type (its classification), status, engine_load."""
    return httpx.get(f"{url}/workers", headers=headers, timeout=10).json()["workers"]


def wait_smg_workers(url: str, process: subprocess.Popen, workers: int, headers: dict[str, str] | None = None,
                     timeout_s: float = WORKERS_READY_TIMEOUT_S, log_path: str | None = None) -> list[dict]:
    """The worker listing once `workers` workers are ready; RuntimeError if SMG exits or the
    timeout passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            listed = smg_workers(url, headers)
        except httpx.TransportError:  # not listening yet
            listed = []
        if sum(worker["status"] == "ready" for worker in listed) == workers:
            return listed
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"SMG never had {workers} ready workers: {listed}; its log: {log_path}")
        time.sleep(POLL_S)

"""SMG (Shepherd Model Gateway, `pip install 'chunkserve[fleet]'`) as a real process on
127.0.0.1 in front of chunkserve servers: started by the servers' harness, up once every worker
it was given is registered and ready (its /health answers before that), stopped with its group."""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

from chunkserve.bench.smg import smg_command, smg_workers, wait_smg_workers
from tests.server_process import API_KEY, Server, free_port, start_command, stop_server

WORKERS_READY_TIMEOUT_S = 60
HEADERS = {"Authorization": f"Bearer {API_KEY}"}  # SMG's --api-key guards its own API and is sent to the workers


@dataclass
class Gateway:
    server: Server  # the smg process as the harness started it
    metrics_url: str  # its Prometheus listener

    @property
    def base_url(self) -> str:
        return self.server.base_url

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.base_url + path, json=body, headers=HEADERS, timeout=180)

    def workers(self) -> list[dict]:
        return smg_workers(self.base_url, HEADERS)

    def metrics(self) -> str:
        return httpx.get(self.metrics_url, timeout=10).text

    def wait_for(self, condition, what: str, timeout_s: float = WORKERS_READY_TIMEOUT_S) -> list[dict]:
        """The worker listing once `condition(workers)` holds."""
        deadline = time.monotonic() + timeout_s
        while True:
            workers = self.workers()
            if condition(workers):
                return workers
            if self.server.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"SMG never had {what}: {workers}; its log: {self.server.log_path}")
            time.sleep(0.1)


def start_smg(tmp_path_factory, *flags: str, workers: int, name: str = "smg") -> Gateway:
    """`smg launch FLAGS` (the harness adds --port), with the tests' API key for the workers;
    returned once `workers` workers are ready."""
    metrics_port = free_port()
    server = start_command(tmp_path_factory, smg_command(*flags, metrics_port=metrics_port, api_key=API_KEY),
                           name=name)
    gateway = Gateway(server, f"http://127.0.0.1:{metrics_port}/metrics")
    try:
        wait_smg_workers(gateway.base_url, server.process, workers, HEADERS, log_path=server.log_path)
    except BaseException:
        stop_smg(gateway)
        raise
    return gateway


def stop_smg(gateway: Gateway) -> None:
    stop_server(gateway.server)


def replica_that_counted(replicas: list[Server], metric: str, before: list[float], timeout_s: float = 30.0) -> int:
    """The index of the one replica whose `metric` (a key of Server.metrics) rose past `before`
    once their total did by one: which replica served the request just answered."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = [replica.metrics().get(metric, 0.0) for replica in replicas]
        if sum(counts) >= sum(before) + 1:
            risen = [index for index, (count, old) in enumerate(zip(counts, before)) if count > old]
            assert len(risen) == 1, f"{metric} rose on several replicas: {before} -> {counts}"
            return risen[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"no replica counted the request in {metric}: {before} -> {counts}")
        time.sleep(0.05)

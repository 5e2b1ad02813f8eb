"""The router's Prometheus metrics, `chunkserve:router_*`, in a registry of their own (a test
process may build several routers; the global registry would refuse the second)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 600.0)


class RouterMetrics:
    def __init__(self, instances: list[tuple[str, str]]) -> None:
        """`instances`: (role, url) of every upstream, shown from the start (unhealthy, idle)."""
        self.registry = CollectorRegistry()
        self.requests = Counter("chunkserve:router_requests", "Client requests by route and the status answered "
                                "(499: the client left before the status)", ["route", "status"],
                                registry=self.registry)
        self.upstream_requests = Counter(
            "chunkserve:router_upstream_requests", "Requests sent to upstream instances by the status they answered "
            "(error: no answer)", ["role", "instance", "status"], registry=self.registry)
        self.in_flight = Gauge("chunkserve:router_requests_in_flight", "Requests of this router an instance is serving",
                               ["role", "instance"], registry=self.registry)
        self.healthy = Gauge("chunkserve:router_instance_healthy", "1 while an instance takes requests, else 0",
                             ["role", "instance"], registry=self.registry)
        self.duration = Histogram("chunkserve:router_request_duration_seconds",
                                  "Client request arrival to the end of its answer", ["route"],
                                  buckets=_DURATION_BUCKETS, registry=self.registry)
        for role, url in instances:
            self.in_flight.labels(role, url).set(0)
            self.healthy.labels(role, url).set(0)

    def request_done(self, route: str, status: int, duration_s: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.duration.labels(route).observe(duration_s)

    def upstream_answered(self, role: str, url: str, status: int | str) -> None:
        self.upstream_requests.labels(role, url, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""The upstream instances: which prefill and decode servers take requests now, and which one
takes the next.

Health: every instance is checked on its own every `interval` seconds (GET /health must answer
200, GET /server_info must name the instance's role). One good check puts it in rotation;
`failure_threshold` failed checks in a row take it out. Two things take it out at once: a
/server_info that names another role (a decode URL given as --prefill), and a request the
router could not deliver (`mark_unreachable`). Instances start out of rotation and the first
check runs as the router starts: the router does not wait for servers still loading.

Choice: the healthy instance of the role with the fewest requests in flight from this router;
ties go round-robin, so sequential requests alternate.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import Literal

import httpx

from chunkserve.entrypoints.router.args import RouterConfig, UpstreamSpec
from chunkserve.entrypoints.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)
Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")
NOT_CHECKED = "not checked yet"


@dataclass(eq=False)
class Instance:
    role: Role
    url: str  # scheme://host:port
    configured_bootstrap_port: int | None  # from the command line; wins over /server_info's
    bootstrap_port: int | None = None  # prefill: where its KV is fetched from; known once checked
    healthy: bool = False
    problem: str | None = NOT_CHECKED  # why it is (or will soon be) out of rotation; None when fine
    failures: int = 0  # failed health checks in a row
    in_flight: int = 0  # requests from this router it is serving

    @property
    def host(self) -> str:
        return httpx.URL(self.url).host


class InstancePool:
    def __init__(self, config: RouterConfig, metrics: RouterMetrics) -> None:
        def instances(role: Role, specs: tuple[UpstreamSpec, ...]) -> list[Instance]:
            return [Instance(role, spec.url, spec.bootstrap_port, spec.bootstrap_port) for spec in specs]

        self.instances: dict[Role, list[Instance]] = {"prefill": instances("prefill", config.prefill),
                                                      "decode": instances("decode", config.decode)}
        self.metrics = metrics
        self.interval = config.health_check_interval
        self.failure_threshold = config.health_failure_threshold
        self._turns = {role: itertools.count() for role in ROLES}

    def all(self) -> list[Instance]:
        return [instance for role in ROLES for instance in self.instances[role]]

    def missing_role(self) -> Role | None:
        """A role no healthy instance serves (the router cannot answer then), or None."""
        return next((role for role in ROLES if not any(i.healthy for i in self.instances[role])), None)

    def pick(self, role: Role) -> Instance | None:
        """The instance to send the next request of `role` to, counted in flight until `release`;
        None when none is healthy."""
        instances = self.instances[role]
        start = next(self._turns[role]) % len(instances)
        rotated = instances[start:] + instances[:start]
        chosen = min((i for i in rotated if i.healthy), key=lambda i: i.in_flight, default=None)
        if chosen is not None:
            self._count(chosen, +1)
        return chosen

    def release(self, instance: Instance) -> None:
        self._count(instance, -1)

    def mark_unreachable(self, instance: Instance, error: Exception) -> None:
        """A request could not be delivered: out of rotation until a health check succeeds."""
        self._failed(instance, f"unreachable ({error!r})", at_once=True)

    async def watch(self, client: httpx.AsyncClient) -> None:
        """Check every instance every `interval` seconds, until cancelled."""
        await asyncio.gather(*(self._watch_one(client, instance) for instance in self.all()))

    async def _watch_one(self, client: httpx.AsyncClient, instance: Instance) -> None:
        while True:
            await self.check(client, instance)
            await asyncio.sleep(self.interval)

    async def check(self, client: httpx.AsyncClient, instance: Instance) -> None:
        timeout = max(self.interval, 1.0)
        try:
            health, info = await asyncio.gather(client.get(f"{instance.url}/health", timeout=timeout),
                                                client.get(f"{instance.url}/server_info", timeout=timeout))
        except httpx.HTTPError as error:
            self._failed(instance, f"health check failed ({error!r})")
            return
        if health.status_code != 200:
            self._failed(instance, f"/health answered {health.status_code}")
            return
        try:
            info_body = info.json() if info.status_code == 200 else None
        except ValueError:
            info_body = None
        if not isinstance(info_body, dict):
            self._failed(instance, f"/server_info answered {info.status_code} without a JSON object")
            return
        mode = info_body.get("disaggregation_mode")
        if mode != instance.role:
            hint = f" or give it to the router as --{mode}" if mode in ROLES else ""
            self._failed(instance, f"its /server_info says disaggregation_mode={mode!r} but it was given as "
                                   f"--{instance.role}; start it with --disaggregation-mode {instance.role}{hint}",
                         at_once=True, level=logging.ERROR)
            return
        if instance.role == "prefill" and instance.configured_bootstrap_port is None:
            port = info_body.get("disaggregation_bootstrap_port")
            if not isinstance(port, int) or isinstance(port, bool):
                self._failed(instance, f"its /server_info gives no disaggregation_bootstrap_port (got {port!r}); "
                                       "give it after the URL: --prefill URL BOOTSTRAP_PORT", at_once=True,
                             level=logging.ERROR)
                return
            instance.bootstrap_port = port
        self._succeeded(instance)

    def _succeeded(self, instance: Instance) -> None:
        instance.failures = 0
        instance.problem = None
        if not instance.healthy:
            logger.info("%s instance %s is healthy", instance.role, instance.url)
            self._set_healthy(instance, True)

    def _failed(self, instance: Instance, problem: str, at_once: bool = False, level: int = logging.WARNING) -> None:
        """`at_once`: out of rotation now, whatever the threshold; `level`: of the log line, written
        when the instance leaves the rotation, or is out of it with a new problem."""
        instance.failures += 1
        taken_out = instance.healthy and (at_once or instance.failures >= self.failure_threshold)
        if taken_out:
            self._set_healthy(instance, False)
        if taken_out or (not instance.healthy and problem != instance.problem):
            logger.log(level, "%s instance %s is out of rotation: %s", instance.role, instance.url, problem)
        instance.problem = problem

    def _set_healthy(self, instance: Instance, healthy: bool) -> None:
        instance.healthy = healthy
        self.metrics.healthy.labels(instance.role, instance.url).set(int(healthy))

    def _count(self, instance: Instance, delta: int) -> None:
        instance.in_flight += delta
        self.metrics.in_flight.labels(instance.role, instance.url).set(instance.in_flight)

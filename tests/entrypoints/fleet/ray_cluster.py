"""A two-node Ray cluster on loopback running chunkserve's Serve application
(chunkserve/entrypoints/ray_serve.py), for tests/entrypoints/fleet/test_ray_serve.py: each node
has one CPU, so Serve must place the two replicas one per node."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

APP_NAME = "chunkserve"
REPLICA_CLASS = f"ServeReplica:{APP_NAME}:ChunkserveServer"
OBJECT_STORE_BYTES = 80 * 1024 * 1024  # Ray's minimum is 75 MiB; the test moves a few kilobytes
START_TIMEOUT_S = 180.0


@dataclass
class RayFleet:
    cluster: Any  # ray.cluster_utils.Cluster
    base_url: str

    def replicas(self) -> dict[str, str]:
        """The live chunkserve replicas: actor name -> node id. (Ray's public state API needs the
        dashboard, which the cluster runs without; the GCS's actor table is what it reads.)"""
        from ray._private.state import actors

        return {a["Name"]: a["Address"]["NodeID"] for a in actors().values()
                if a.get("ActorClassName") == REPLICA_CLASS and a.get("State") == "ALIVE"}

    def kill_replica(self, replica_id: str) -> str:
        """As a crash would: the actor of the replica `replica_id` (what responses name in their
        x-chunkserve-replica header) dies at once, and Serve's controller has to replace it.
        Returns the actor's name."""
        import ray

        name = next(name for name in self.replicas() if name.endswith(f"#{replica_id}"))
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        return name

    def wait_until_serving(self, replicas: int, condition: Callable[[dict[str, str]], bool] = lambda _: True,
                           timeout_s: float = START_TIMEOUT_S) -> dict[str, str]:
        """The replicas once `replicas` of them are alive, meet `condition` and the app is RUNNING."""
        from ray import serve

        deadline = time.monotonic() + timeout_s
        while True:
            found = self.replicas()
            status = serve.status().applications.get(APP_NAME)
            if len(found) == replicas and condition(found) and status is not None and status.status == "RUNNING":
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"the Serve app never had {replicas} running replicas: {found}, {status}")
            time.sleep(0.2)


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ while the cluster starts: its raylets, and so its workers, inherit them."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def start_fleet(app_fields: dict[str, Any], port: int, env: dict[str, str]) -> RayFleet:
    """Two one-CPU nodes (dashboard off), Serve's HTTP proxy on 127.0.0.1:`port`, and the app
    built from `app_fields` (build_chunkserve_app's); returns once every replica serves."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from chunkserve.entrypoints.ray_serve import build_chunkserve_app

    with environment(env):
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "object_store_memory": OBJECT_STORE_BYTES, "include_dashboard": False})
        cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE_BYTES)
    fleet = RayFleet(cluster, f"http://127.0.0.1:{port}")
    try:
        ray.init(address=cluster.address, logging_level="warning", log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_chunkserve_app(app_fields), name=APP_NAME, route_prefix="/")
        fleet.wait_until_serving(app_fields.get("num_replicas", 1))
    except BaseException:
        stop_fleet(fleet)
        raise
    return fleet


def stop_fleet(fleet: RayFleet) -> None:
    import ray
    from ray import serve

    try:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
    finally:
        fleet.cluster.shutdown()

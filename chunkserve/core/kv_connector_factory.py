"""One table of the KV connectors (as vLLM's KVConnectorFactory): the configured connector's
name (`KVConnectorConfig.connector`) -> its scheduler side (built by the engine core) and its
worker side (built by each worker). Classes are named by module path and imported when built,
so the engine core never imports the worker sides (torch) and adding a connector is one row."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import NamedTuple

from chunkserve.config.kv_connector import KVConnectorConfig
from chunkserve.core.kv.layout import ModelFingerprint
from chunkserve.core.kv_connector import KVConnectorScheduler, KVConnectorWorker


class ConnectorSides(NamedTuple):
    scheduler: str  # "module:Class", built as Class.from_config(config, fingerprint)
    worker: str


CONNECTORS: dict[str, ConnectorSides] = {
    "hicache": ConnectorSides("chunkserve.core.kv.disk_tier:DiskTierScheduler",
                              "chunkserve.worker.disk_tier:DiskTierWorker"),
    "prefill": ConnectorSides("chunkserve.core.disagg.prefill:PrefillConnectorScheduler",
                              "chunkserve.worker.disagg.prefill:PrefillConnectorWorker"),
    "decode": ConnectorSides("chunkserve.core.disagg.decode:DecodeConnectorScheduler",
                             "chunkserve.worker.disagg.decode:DecodeConnectorWorker"),
}


def connector_class(name: str, side: str) -> type:
    """The class of `side` ("scheduler" or "worker") of the connector `name`."""
    module, _, cls = getattr(CONNECTORS[name], side).partition(":")
    return getattr(importlib.import_module(module), cls)


def _build(side: str, config: KVConnectorConfig, fingerprint: Callable[[], ModelFingerprint]):
    if config.connector is None:
        return None
    return connector_class(config.connector, side).from_config(config, fingerprint)


def build_scheduler_side(config: KVConnectorConfig,
                         fingerprint: Callable[[], ModelFingerprint]) -> KVConnectorScheduler | None:
    """The scheduler's side of the configured connector (None: none). `fingerprint`: the model's
    KV fingerprint, computed only by the connectors that name their data by it."""
    return _build("scheduler", config, fingerprint)


def build_worker_side(config: KVConnectorConfig,
                      fingerprint: Callable[[], ModelFingerprint]) -> KVConnectorWorker | None:
    """The worker's side of the configured connector (None: none)."""
    return _build("worker", config, fingerprint)

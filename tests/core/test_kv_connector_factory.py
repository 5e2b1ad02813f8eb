"""The KV connector table: the configured connector picks both of its sides from one row."""

from __future__ import annotations

import pytest

from chunkserve.config.disaggregation import DisaggregationConfig
from chunkserve.config.kv_connector import KVConnectorConfig
from chunkserve.config.kv_tier import KVTierConfig
from chunkserve.core.disagg.decode import DecodeConnectorScheduler
from chunkserve.core.disagg.prefill import PrefillConnectorScheduler
from chunkserve.core.kv.disk_tier import DiskTierScheduler
from chunkserve.core.kv.layout import KVLayout, ModelFingerprint
from chunkserve.core.kv_connector import KVConnectorScheduler, KVConnectorWorker
from chunkserve.core.kv_connector_factory import CONNECTORS, build_scheduler_side, connector_class
from chunkserve.worker.disagg.decode import DecodeConnectorWorker
from chunkserve.worker.disagg.prefill import PrefillConnectorWorker
from chunkserve.worker.disk_tier import DiskTierWorker

FINGERPRINT = ModelFingerprint("w" * 64, "t" * 64, KVLayout("float32", num_layers=1, num_kv_heads=1, head_dim=8, block_size=4))


def config(mode: str = "null", hicache: bool = False, storage_dir: str | None = None) -> KVConnectorConfig:
    return KVConnectorConfig(4, KVTierConfig(hicache, hicache_storage_dir=storage_dir),
                             DisaggregationConfig(mode, disaggregation_waiting_timeout=7.0))


@pytest.mark.parametrize("name, scheduler_side, worker_side", [
    ("hicache", DiskTierScheduler, DiskTierWorker),
    ("prefill", PrefillConnectorScheduler, PrefillConnectorWorker),
    ("decode", DecodeConnectorScheduler, DecodeConnectorWorker),
])
def test_each_connector_names_its_scheduler_and_worker_sides(name, scheduler_side, worker_side):
    assert connector_class(name, "scheduler") is scheduler_side
    assert connector_class(name, "worker") is worker_side
    assert issubclass(scheduler_side, KVConnectorScheduler) and issubclass(worker_side, KVConnectorWorker)


def test_every_row_is_a_configurable_connector():
    assert set(CONNECTORS) == {"hicache", *(m for m in DisaggregationConfig.__dataclass_fields__["disaggregation_mode"]
                                            .metadata["choices"] if m != "null")}


def test_no_connector_is_configured_by_default():
    assert build_scheduler_side(config(), lambda: FINGERPRINT) is None


def test_the_disaggregation_scheduler_sides_are_built_from_their_leaf_without_the_fingerprint():
    def no_fingerprint():
        raise AssertionError("the disaggregation scheduler sides do not hash the weights")

    decode = build_scheduler_side(config("decode"), no_fingerprint)
    assert isinstance(decode, DecodeConnectorScheduler)
    assert (decode.block_size, decode.waiting_timeout) == (4, 7.0)
    assert isinstance(build_scheduler_side(config("prefill"), no_fingerprint), PrefillConnectorScheduler)


def test_the_disk_tier_scheduler_side_keeps_its_blocks_under_the_configured_folder(tmp_path):
    tier = build_scheduler_side(config(hicache=True, storage_dir=str(tmp_path)), lambda: FINGERPRINT)
    assert isinstance(tier, DiskTierScheduler)
    assert tier.files.folder.startswith(str(tmp_path))

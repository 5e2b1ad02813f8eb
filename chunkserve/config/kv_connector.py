"""What the KV connectors read, and which connector the flags choose: the disk tier
(KVTierConfig) or one side of prefill/decode disaggregation (DisaggregationConfig). One
connector per engine; core/kv_connector_factory.py builds its two sides."""

from __future__ import annotations

from dataclasses import dataclass

from chunkserve.config.disaggregation import DisaggregationConfig
from chunkserve.config.kv_tier import KVTierConfig
from chunkserve.errors import InvalidRequestError


@dataclass(frozen=True)
class KVConnectorConfig:
    block_size: int
    kv_tier: KVTierConfig
    disaggregation: DisaggregationConfig

    def __post_init__(self) -> None:
        if self.disaggregation.disaggregation_mode != "null" and self.kv_tier.enable_hierarchical_cache:
            raise InvalidRequestError("disaggregation_mode and enable_hierarchical_cache cannot be combined yet (one "
                                      "KV connector per engine)")

    @property
    def connector(self) -> str | None:
        """The configured connector's name in core/kv_connector_factory.py's table; None: none."""
        if self.kv_tier.enable_hierarchical_cache:
            return "hicache"
        if self.disaggregation.disaggregation_mode != "null":
            return self.disaggregation.disaggregation_mode
        return None

"""`--kv-events-config`: publishing what the prefix cache holds, for routers that place
requests by it. vLLM's JSON, its keys and defaults, so a vLLM deployment's flag works as is:

    --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                         "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'

`max_queue_size` is accepted and unused: the engine sends each step's batch itself between
steps (libzmq's own thread does the I/O), so there is no queue in front of the socket; `hwm`
bounds what the socket holds for a slow subscriber (beyond it, batches are dropped, as with
vLLM, and the replay socket is how a subscriber catches up).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chunkserve.config.fields import parse_json_object
from chunkserve.errors import InvalidRequestError

KV_EVENT_PUBLISHERS = ("null", "zmq")


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" when events are enabled and none is named (vLLM's rule)
    endpoint: str = "tcp://*:5557"  # bound if it has *, :: or is ipc:// / inproc://; connected to otherwise
    replay_endpoint: str | None = None  # a ROUTER socket answering "batches since sequence number N"
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: str | dict[str, Any] | KVEventsConfig | None) -> KVEventsConfig | None:
        """From `--kv-events-config`'s JSON text, or the same as a dict (the Python API); None:
        no events."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        fields = parse_json_object("kv_events_config", value, set(cls.__dataclass_fields__))
        enabled = fields.get("enable_kv_cache_events", False)
        if not isinstance(enabled, bool):
            raise InvalidRequestError(f"kv_events_config enable_kv_cache_events must be true or false, got {enabled!r}")
        fields.setdefault("publisher", "zmq" if enabled else "null")
        if fields["publisher"] not in KV_EVENT_PUBLISHERS:
            raise InvalidRequestError(f"kv_events_config publisher must be one of {KV_EVENT_PUBLISHERS}, "
                                      f"got {fields['publisher']!r}")
        for name in ("endpoint", "topic"):
            if name in fields and not isinstance(fields[name], str):
                raise InvalidRequestError(f"kv_events_config {name} must be a string, got {fields[name]!r}")
        replay = fields.get("replay_endpoint")
        if replay is not None and not isinstance(replay, str):
            raise InvalidRequestError(f"kv_events_config replay_endpoint must be a string or null, got {replay!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            number = fields.get(name, 1)
            if not isinstance(number, int) or isinstance(number, bool) or number < 1:
                raise InvalidRequestError(f"kv_events_config {name} must be a positive integer, got {number!r}")
        config = cls(**fields)
        if config.publishes and replay is not None and replay == config.endpoint:
            raise InvalidRequestError("kv_events_config endpoint and replay_endpoint must differ, both are "
                                      f"{replay!r}")
        return config

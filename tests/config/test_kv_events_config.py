"""`--kv-events-config`: vLLM's JSON keys and defaults (a vLLM deployment's flag works as is),
what is refused (each refusal names the key at fault), and prefix caching as a requirement."""

from __future__ import annotations

import json

import pytest

from chunkserve.config.engine import EngineArgs
from chunkserve.config.kv_events import KVEventsConfig
from chunkserve.errors import InvalidRequestError

VLLM_EXAMPLE = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                "replay_endpoint": "tcp://*:5558", "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000,
                "topic": ""}


def test_vllm_keys_and_defaults():
    assert KVEventsConfig.parse(json.dumps(VLLM_EXAMPLE)) == KVEventsConfig(**VLLM_EXAMPLE)
    enabled = KVEventsConfig.parse({"enable_kv_cache_events": True})
    assert enabled.publishes and enabled.publisher == "zmq" and enabled.endpoint == "tcp://*:5557"
    assert enabled.replay_endpoint is None and enabled.buffer_steps == 10_000
    assert not KVEventsConfig.parse({"publisher": "zmq"}).publishes  # (events off, as vLLM)
    assert not KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "null"}).publishes
    assert KVEventsConfig.parse(None) is None


@pytest.mark.parametrize("value, named", [
    ('{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}', "endpont"),
    ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events"),
    ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher"),
    ({"enable_kv_cache_events": True, "endpoint": 5557}, "endpoint"),
    ({"enable_kv_cache_events": True, "replay_endpoint": 5558}, "replay_endpoint"),
    ({"enable_kv_cache_events": True, "buffer_steps": 0}, "buffer_steps"),
    ({"enable_kv_cache_events": True, "hwm": True}, "hwm"),
    ({"enable_kv_cache_events": True, "replay_endpoint": "tcp://*:5557"}, "replay_endpoint"),
    ("[1]", "JSON object"),
])
def test_refusals_name_the_key(value, named):
    with pytest.raises(InvalidRequestError, match=named):
        KVEventsConfig.parse(value)


def test_events_need_prefix_caching():
    with pytest.raises(InvalidRequestError, match="enable_prefix_caching"):
        EngineArgs(kv_events_config={"enable_kv_cache_events": True}, enable_prefix_caching=False)
    args = EngineArgs(kv_events_config=VLLM_EXAMPLE)
    assert args.scheduler_config(2048).enable_kv_cache_events
    assert not EngineArgs().scheduler_config(2048).enable_kv_cache_events

"""The snapshot's wire format on its own: a round trip keeps every field, and bytes that are
not a whole snapshot are refused with a message saying so."""

from __future__ import annotations

import dataclasses
import zlib

import pytest

from chunkserve.core.kv.kv_cache_manager import hash_block, root_hash
from chunkserve.core.kv.layout import KVLayout, ModelFingerprint
from chunkserve.core.kv.snapshot import RequestSnapshot, SnapshotBlock, SnapshotError
from chunkserve.sampling_params import RequestOutputKind, SamplingParams

LAYOUT = KVLayout("float32", num_layers=2, num_kv_heads=1, head_dim=2, block_size=2)
FINGERPRINT = ModelFingerprint("a" * 64, "b" * 64, LAYOUT)


def snapshot() -> RequestSnapshot:
    tokens = [5, 6, 7, 8]
    payloads = [bytes(range(LAYOUT.block_bytes)), bytes(reversed(range(LAYOUT.block_bytes)))]
    return RequestSnapshot(
        FINGERPRINT, "r#1", tokens[:2], tokens[2:], 3,
        SamplingParams(max_tokens=9, seed=3, stop=["x"], logit_bias={4: 1.5}, output_kind=RequestOutputKind.DELTA),
        b"\x01\x02", eos_token_id=2, arrival_time=12.5, priority=1, cache_salt="s", num_cached_tokens=2,
        blocks=[SnapshotBlock(hash_block(root_hash("s"), tokens[:2]), zlib.crc32(payloads[0]), payloads[0]),
                SnapshotBlock(None, zlib.crc32(payloads[1]), payloads[1])],
        frontend_state={"request_id": "r", "prompt": None, "metrics": {}, "logprobs": None,
                        "detokenizer": {"text": "é", "prefix_offset": 0, "read_offset": 1, "num_emitted": 1}},
    )


def test_round_trip_keeps_every_field():
    original = snapshot()
    copy = RequestSnapshot.from_bytes(original.to_bytes())
    assert copy == original
    copy.verify(FINGERPRINT)


def test_malformed_snapshot_bytes_are_refused():
    data = snapshot().to_bytes()
    with pytest.raises(SnapshotError, match="bad magic"):
        RequestSnapshot.from_bytes(b"not a snapshot at all")
    with pytest.raises(SnapshotError, match="truncated"):
        RequestSnapshot.from_bytes(data[:-1])
    with pytest.raises(SnapshotError, match="after its last block"):
        RequestSnapshot.from_bytes(data + b"\0")
    with pytest.raises(SnapshotError, match="malformed"):
        RequestSnapshot.from_bytes(data[:20] + b"}" + data[21:])
    with pytest.raises(SnapshotError, match="version 7 is not supported"):
        RequestSnapshot.from_bytes(data[:9] + b"\x07" + data[10:])
    with pytest.raises(SnapshotError, match="frontend state has fields"):
        RequestSnapshot.from_bytes(dataclasses.replace(snapshot(), frontend_state={"request_id": "r"}).to_bytes())


@pytest.mark.parametrize("prompt, message", [([], "empty prompt"), ([5, 6.5], "not all integers")])
def test_verify_refuses_impossible_tokens(prompt, message):
    with pytest.raises(SnapshotError, match=message):
        dataclasses.replace(snapshot(), prompt_token_ids=prompt).verify(FINGERPRINT)

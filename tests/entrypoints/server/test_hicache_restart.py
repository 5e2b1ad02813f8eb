"""Restart survival of the disk KV tier, with real server processes: a chat turn on a server
with the tier, the server stopped (SIGTERM) and started again on the same folder, then the
next turn: its cached tokens cover the whole history but the last partial block, and its
output equals a cold server's."""

from __future__ import annotations

import random
import signal

import pytest

from tests.server_process import start_server, stop_server

BLOCK = 16


def generate(server, input_ids: list[int]) -> dict:
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
    with server.client() as http:
        response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def stop_gracefully(server) -> None:
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(120) == 0


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_a_restarted_server_answers_the_next_turn_from_disk(tmp_path_factory, tmp_path, policy):
    flags = ["--num-kv-blocks", "128", "--enable-hierarchical-cache", "--hicache-write-policy", policy,
             "--hicache-storage-dir", str(tmp_path)]
    rng = random.Random(5)
    first_turn = [rng.randrange(100, 40000) for _ in range(700)]
    server = start_server(tmp_path_factory, *flags, name="hicache-first")
    try:
        answer = generate(server, first_turn)["output_ids"]
    finally:
        stop_gracefully(server)
    history = first_turn + answer
    next_turn = history + [rng.randrange(100, 40000) for _ in range(40)]

    restarted = start_server(tmp_path_factory, *flags, name="hicache-restarted")
    try:
        warm = generate(restarted, next_turn)
        metrics = restarted.metrics()
        assert restarted.check()["ok"]
    finally:
        stop_server(restarted)
    cold_server = start_server(tmp_path_factory, "--num-kv-blocks", "128", name="hicache-cold")
    try:
        cold = generate(cold_server, next_turn)
    finally:
        stop_server(cold_server)

    # the history's KV but its last sampled token's (never computed), in whole blocks
    assert warm["meta_info"]["cached_tokens"] == (len(history) - 1) // BLOCK * BLOCK
    assert metrics["chunkserve:hicache_hit_tokens_total{}"] == warm["meta_info"]["cached_tokens"]
    assert cold["meta_info"]["cached_tokens"] == 0
    assert warm["output_ids"] == cold["output_ids"]

"""Restart survival of the disk KV tier, with real server processes on the tiny model: a chat
turn on a server with the tier, the server stopped (SIGTERM) and started again on the same
folder, then the next turn: its cached tokens cover the whole history but the last partial
block, and its output equals a cold server's."""

from __future__ import annotations

import random
import signal

import pytest

from tests.server_process import start_server, stop_server
from tests.tiny_model import TINY_SERVER_ENV, tiny_server_flags

BLOCK = 16


def turns() -> tuple[list[int], list[int]]:
    """The first turn's prompt and the ids the next turn appends after the first answer."""
    rng = random.Random(5)
    first_turn = [rng.randrange(100, 40000) for _ in range(700)]
    return first_turn, [rng.randrange(100, 40000) for _ in range(40)]


def generate(server, input_ids: list[int]) -> dict:
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
    with server.client() as http:
        response = http.post("/generate", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def stop_gracefully(server) -> None:
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(120) == 0


@pytest.fixture(scope="module")
def cold_reference(tmp_path_factory, tiny_gguf) -> tuple[list[int], dict]:
    """A server without the tier, once for both policies (their turns are the same tokens): its
    answer to the first turn, and its answer to the next turn computed from scratch (the prefix
    cache emptied in between)."""
    first_turn, appended = turns()
    server = start_server(tmp_path_factory, *tiny_server_flags(tiny_gguf, max_model_len=2048), "--num-kv-blocks",
                          "128", name="hicache-cold", env=TINY_SERVER_ENV)
    try:
        answer = generate(server, first_turn)["output_ids"]
        with server.admin_client() as admin:
            assert admin.post("/reset_prefix_cache").status_code == 200
        return answer, generate(server, first_turn + answer + appended)
    finally:
        stop_server(server)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_a_restarted_server_answers_the_next_turn_from_disk(tmp_path_factory, tmp_path, tiny_gguf, cold_reference,
                                                            policy):
    flags = [*tiny_server_flags(tiny_gguf, max_model_len=2048), "--num-kv-blocks", "128",
             "--enable-hierarchical-cache", "--hicache-write-policy", policy, "--hicache-storage-dir", str(tmp_path)]
    first_turn, appended = turns()
    server = start_server(tmp_path_factory, *flags, name="hicache-first", env=TINY_SERVER_ENV)
    try:
        answer = generate(server, first_turn)["output_ids"]
    finally:
        stop_gracefully(server)
    cold_answer, cold = cold_reference
    assert answer == cold_answer  # so the cold next turn is this history's
    history = first_turn + answer
    next_turn = history + appended

    restarted = start_server(tmp_path_factory, *flags, name="hicache-restarted", env=TINY_SERVER_ENV)
    try:
        warm = generate(restarted, next_turn)
        metrics = restarted.metrics()
        assert restarted.check()["ok"]
    finally:
        stop_server(restarted)

    # the history's KV but its last sampled token's (never computed), in whole blocks
    assert warm["meta_info"]["cached_tokens"] == (len(history) - 1) // BLOCK * BLOCK
    assert metrics["chunkserve:hicache_hit_tokens_total{}"] == warm["meta_info"]["cached_tokens"]
    assert cold["meta_info"]["cached_tokens"] == 0
    assert warm["output_ids"] == cold["output_ids"]

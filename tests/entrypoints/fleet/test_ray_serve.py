"""chunkserve replicas on Ray Serve (chunkserve/entrypoints/ray_serve.py), as a Ray user runs
them: a two-node cluster on loopback, two replicas placed one per node, Ray Serve LLM's
PrefixCacheAffinityRouter, requests through Serve's HTTP proxy with the official openai client."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import openai
import pytest

from chunkserve.engine.core import TEST_STEP_DELAY_ENV
from chunkserve.errors import InvalidRequestError
from tests.entrypoints.fleet.ray_cluster import RayFleet, start_fleet, stop_fleet
from tests.server_process import API_KEY, Server, free_port, start_server, stop_server
from tests.tiny_model import (
    STEP_DELAY_MS,
    TINY_MAX_POSITIONS,
    TINY_SERVER_ENV,
    tiny_server_flags,
)

pytestmark = pytest.mark.slow


BLOCK_SIZE = 16  # EngineArgs' default: what a prefix-cache hit is counted in
REPLICA_HEADER = "x-chunkserve-replica"  # names the replica that answered
CASES = [  # (route, request fields): greedy and seeded, streamed and not
    ("chat", {"temperature": 0.0}),
    ("chat", {"temperature": 1.0, "seed": 7, "stream": True}),
    ("completions", {"temperature": 0.0, "stream": True}),
    ("completions", {"temperature": 0.9, "top_p": 0.8, "seed": 11}),
]


@pytest.fixture(scope="module")
def standalone(tmp_path_factory, tiny_gguf) -> Iterator[Server]:
    server = start_server(tmp_path_factory, *tiny_server_flags(tiny_gguf), name="ray-standalone", env=TINY_SERVER_ENV)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def fleet(tiny_gguf) -> Iterator[RayFleet]:
    """The standalone server's engine flags (float32, its KV budget); each step sleeps a little,
    so that a request is still running when a test kills its replica."""
    engine_kwargs = {"model": tiny_gguf, "max_model_len": TINY_MAX_POSITIONS, "dtype": "float32",
                     "kv_cache_memory_gb": 0.25}
    fleet = start_fleet({"engine_kwargs": engine_kwargs, "num_replicas": 2}, free_port(),
                        {TEST_STEP_DELAY_ENV: str(STEP_DELAY_MS // 4)})
    yield fleet
    stop_fleet(fleet)


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def answer(http: openai.OpenAI, route: str, fields: dict, text: str) -> tuple[str, str]:
    """(the answer's text, its finish_reason), read from the stream when `fields` asks for one."""
    model = http.models.list().data[0].id
    if route == "chat":
        response = http.chat.completions.create(model=model, messages=[{"role": "user", "content": text}],
                                                max_tokens=12, **fields)
        if not fields.get("stream"):
            return response.choices[0].message.content, response.choices[0].finish_reason
        chunks = [c.choices[0] for c in response if c.choices]
        return "".join(c.delta.content or "" for c in chunks), chunks[-1].finish_reason
    response = http.completions.create(model=model, prompt=text, max_tokens=12, **fields)
    if not fields.get("stream"):
        return response.choices[0].text, response.choices[0].finish_reason
    chunks = [c.choices[0] for c in response if c.choices]
    return "".join(c.text for c in chunks), chunks[-1].finish_reason


def test_serve_places_one_replica_per_node(fleet):
    replicas = fleet.replicas()
    assert len(replicas) == 2 and len(set(replicas.values())) == 2, replicas


def test_answers_equal_a_standalone_servers(fleet, standalone):
    ray_client, own_client = client(fleet.base_url), client(standalone.base_url)
    for index, (route, fields) in enumerate(CASES):
        text = f"case {index}: tell me about {route} with {sorted(fields)}"
        assert answer(ray_client, route, fields, text) == answer(own_client, route, fields, text), (route, fields)


def test_a_conversations_next_turn_reads_its_history_from_the_replicas_cache(fleet):
    """Ray's router sends each turn where the conversation's text went before; the replica
    then reads the earlier turns from its prefix cache. Four conversations, so that landing
    there by chance (1 in 2 each) cannot pass the test."""
    http = client(fleet.base_url)
    model = http.models.list().data[0].id
    for conversation in range(4):
        messages = [{"role": "system", "content": f"You are assistant number {conversation}. " * 8},
                    {"role": "user", "content": "Name a colour."}]
        first = http.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And another one?"}]
        second = http.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= first.usage.prompt_tokens - BLOCK_SIZE, (conversation, cached, first.usage)


def test_a_killed_replica_fails_its_requests_cleanly_and_serve_replaces_it(fleet):
    """The requests running on a replica that dies end with an error (not a hang), those on the
    other replica finish; Serve starts a replacement, and requests after it succeed."""
    http = client(fleet.base_url)
    model = http.models.list().data[0].id
    started = [threading.Event() for _ in range(6)]
    replica_of: dict[int, str] = {}
    outcomes: dict[int, str] = {}

    def stream(index: int) -> None:
        try:
            response = http.completions.with_raw_response.create(
                model=model, prompt=f"request {index} " * (index + 1), max_tokens=400, temperature=0, stream=True)
            replica_of[index] = response.headers[REPLICA_HEADER]
            for _ in response.parse():
                started[index].set()
            outcomes[index] = "finished"
        except openai.APIError as error:
            outcomes[index] = f"failed: {error}"
        finally:
            started[index].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(started))]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(60)
    victim = fleet.kill_replica(replica_of[0])
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive(), "a request hung after its replica died"
    assert {i for i, o in outcomes.items() if o.startswith("failed")} == \
        {i for i, r in replica_of.items() if r == replica_of[0]}, (outcomes, replica_of)
    after = fleet.wait_until_serving(2, lambda found: victim not in found)
    assert len(set(after.values())) == 2
    for index, (route, fields) in enumerate(CASES):
        assert answer(http, route, fields, f"after the restart {index}")[1] == "length"


@pytest.mark.parametrize(("fields", "named"), [({"engine_kwargs": {"max_num_batched_token": 512}}, "engine_kwargs"),
                                               ({"request_router": "round_robin"}, "request_router"),
                                               ({"replicas": 2}, "build_chunkserve_app")])
def test_a_wrong_field_is_refused_before_anything_starts(fields, named):
    from chunkserve.entrypoints.ray_serve import build_chunkserve_app

    with pytest.raises(InvalidRequestError, match=named):
        build_chunkserve_app(fields)

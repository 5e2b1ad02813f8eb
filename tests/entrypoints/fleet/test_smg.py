"""SMG (Shepherd Model Gateway, SGLang's router) certified in front of chunkserve, real
processes on 127.0.0.1: two replicas behind `--policy round_robin` and `cache_aware` answer as a
replica does directly, round robin alternates, cache_aware sends a conversation's next turn to
the replica that holds its prefix, and SMG reads each replica's load from its vLLM-named
gauges (`--metrics-compat vllm`); `--pd-disaggregation` in front of a prefill and a decode
instance gives the monolithic server's tokens (the equality cases of test_disaggregation.py; their
completions' prompts as text: SMG 1.13 refuses token-id prompts in /v1/completions) and reads
the instances' load from their SGLang-named gauges (`--metrics-compat sglang`).

What SMG makes of a chunkserve server: `/v1/models` says owned_by "chunkserve", unknown to it;
a server that answers `/version` is taken for vLLM (load from `vllm:` gauges, PD by vLLM's
protocol); a prefill or decode instance does not answer `/version`, so it is taken for SGLang by
its `/server_info` (PD by SGLang's bootstrap fields, which chunkserve speaks; load from `sglang:`
gauges)."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.fleet.smg_support import (
    Gateway,
    replica_that_counted,
    start_smg,
    stop_smg,
)
from tests.entrypoints.server.disaggregation_support import (
    HEADERS,
    assert_outputs_equal_the_monolithic_server,
    assert_same,
    idle,
    prompt_of,
    text_of,
)
from tests.server_process import (
    Server,
    free_port,
    start_server,
    stop_server,
    wait_until_up,
)
from tests.tiny_model import TINY_SERVER_ENV, tiny_server_flags

pytestmark = pytest.mark.slow

SERVED = "tiny"  # the servers' --served-model-name: SMG refuses OpenAI requests without `model`
FINISHED = "chunkserve:request_success_total{finished_reason=length}"
HITS = "chunkserve:prefix_cache_hits_total{}"


def start_tiny(tmp_path_factory, tiny_gguf: str, *flags: str, name: str) -> Server:
    """A tiny-model server of this module, not yet up (`wait_until_up`): the servers load at once."""
    return start_server(tmp_path_factory, *tiny_server_flags(tiny_gguf), "--served-model-name", SERVED, *flags,
                        name=name, env=TINY_SERVER_ENV, wait=False)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory, tiny_gguf):
    servers = [start_tiny(tmp_path_factory, tiny_gguf, "--metrics-compat", "vllm", name=f"replica{i}")
               for i in range(2)]
    try:
        yield [wait_until_up(server) for server in servers]
    finally:
        for server in servers:
            stop_server(server)


def gateway_over(tmp_path_factory, replicas: list[Server], policy: str) -> Gateway:
    return start_smg(tmp_path_factory, "--worker-urls", *(r.base_url for r in replicas), "--policy", policy,
                     workers=len(replicas), name=f"smg-{policy}")


def route(gateway: Gateway, replicas: list[Server], path: str, body: dict) -> tuple[httpx.Response, int]:
    """The gateway's answer and the index of the replica that served it."""
    before = [replica.metrics().get(FINISHED, 0.0) for replica in replicas]
    answer = gateway.post(path, body)
    assert answer.status_code == 200, answer.text
    return answer, replica_that_counted(replicas, FINISHED, before)


def test_round_robin_answers_as_a_replica_does_and_alternates(tmp_path_factory, replicas):
    gateway = gateway_over(tmp_path_factory, replicas, "round_robin")
    try:
        body = {"model": SERVED, "prompt": text_of(replicas[0], prompt_of(100, 1)), "max_tokens": 8, "temperature": 0,
                "logprobs": 2}
        direct = httpx.post(replicas[0].base_url + "/v1/completions", json=body, headers=HEADERS, timeout=180)
        order = []
        for _ in range(4):
            answer, index = route(gateway, replicas, "/v1/completions", body)
            assert_same(direct, answer)
            order.append(index)
        assert order in ([0, 1, 0, 1], [1, 0, 1, 0])
        chat = {"model": SERVED, "messages": [{"role": "user", "content": "Name three rivers of Europe."}],
                "max_tokens": 16, "temperature": 0}
        direct = httpx.post(replicas[1].base_url + "/v1/chat/completions", json=chat, headers=HEADERS, timeout=180)
        assert route(gateway, replicas, "/v1/chat/completions", chat)[0].json()["choices"][0]["message"] == \
            direct.json()["choices"][0]["message"]
    finally:
        stop_smg(gateway)


def conversation(topic: str) -> list[dict]:
    system = f"You are a patient guide to {topic}. " + " ".join(f"Rule {i}: answer about {topic} plainly."
                                                                 for i in range(40))
    return [{"role": "system", "content": system}, {"role": "user", "content": f"Where does {topic} begin?"}]


def test_cache_aware_keeps_a_conversation_on_its_replica_and_reads_their_load(tmp_path_factory, replicas):
    gateway = gateway_over(tmp_path_factory, replicas, "cache_aware")
    try:
        workers = gateway.wait_for(lambda found: all(w.get("engine_load") for w in found), "the replicas' loads")
        assert {w["runtime_type"] for w in workers} == {"vllm"}
        metrics = gateway.metrics()
        assert all(f'smg_engine_token_usage{{worker="{r.base_url}"' in metrics for r in replicas)
        first_turns = {}
        for topic in ("the Danube", "the Rhine"):
            chat = {"model": SERVED, "messages": conversation(topic), "max_tokens": 16, "temperature": 0}
            answer, index = route(gateway, replicas, "/v1/chat/completions", chat)
            first_turns[topic] = (chat, answer.json()["choices"][0]["message"], index)
        assert {index for _, _, index in first_turns.values()} == {0, 1}  # the second went to the emptier tree
        for topic, (chat, reply, index) in first_turns.items():
            hits = replicas[index].metrics().get(HITS, 0.0)
            chat["messages"] += [reply, {"role": "user", "content": "And where does it end?"}]
            answer, second = route(gateway, replicas, "/v1/chat/completions", chat)
            assert second == index, topic
            cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= 256 and replicas[index].metrics()[HITS] - hits == cached
    finally:
        stop_smg(gateway)


@pytest.fixture(scope="module")
def pd(tmp_path_factory, tiny_gguf):
    """A monolithic server, a prefill and a decode instance of one budget (64, test_disaggregation's
    smaller), and SMG pairing the two."""
    budget = ("--max-num-batched-tokens", "64")
    bootstrap_port = free_port()
    sglang_load = ("--metrics-compat", "sglang")
    servers = [start_tiny(tmp_path_factory, tiny_gguf, *budget, name="mono"),
               start_tiny(tmp_path_factory, tiny_gguf, *budget, *sglang_load, "--disaggregation-mode", "prefill",
                          "--disaggregation-bootstrap-port", str(bootstrap_port), name="prefill"),
               start_tiny(tmp_path_factory, tiny_gguf, *sglang_load, "--disaggregation-mode", "decode",
                          name="decode")]
    gateway = None
    try:
        mono, prefill, decode = (wait_until_up(server) for server in servers)
        gateway = start_smg(tmp_path_factory, "--pd-disaggregation", "--prefill", prefill.base_url,
                            str(bootstrap_port), "--decode", decode.base_url, workers=2, name="smg-pd")
        yield mono, prefill, decode, gateway
    finally:
        if gateway is not None:
            stop_smg(gateway)
        for server in servers:
            stop_server(server)


def test_pd_disaggregation_through_smg_gives_the_monolithic_servers_tokens(pd):
    mono, prefill, decode, gateway = pd
    workers = gateway.wait_for(lambda found: all(w.get("engine_load") for w in found), "the instances' loads")
    assert {w["worker_type"]: w["runtime_type"] for w in workers} == {"prefill": "sglang", "decode": "sglang"}

    def post(path: str, body: dict) -> httpx.Response:
        return gateway.post(path, {"model": SERVED, **body} if path.startswith("/v1/") else body)

    assert_outputs_equal_the_monolithic_server(mono, post, text_prompts=True)
    idle(prefill, decode)

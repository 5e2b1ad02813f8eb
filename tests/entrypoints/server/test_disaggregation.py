"""Prefill/decode disaggregation end to end: real `chunkserve serve` processes in both roles and
`chunkserve router --pd-disaggregation` on 127.0.0.1, compared with a monolithic server of the
same budget. What a user of a disaggregated deployment must be able to count on: the same tokens
as one server, the first token deciding alone when it ends the request, every abort and failure
ending the request (never a hang) and giving every block back on both sides, a prefill
instance's death noticed within the heartbeat window.

Every test runs on the tiny GGUF (tests/tiny_model.py) in the default tier and on SmolLM2 in the
long tier (`-m slow`): the `model` fixture parametrizes the whole module."""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import pytest

from chunkserve.config.model import resolve_model
from chunkserve.core.kv.layout import KVLayout
from chunkserve.core.kv.snapshot import RequestSnapshot
from chunkserve.engine.core import TEST_STEP_DELAY_ENV
from chunkserve.model.loader import load_model_config
from tests.entrypoints.server.disaggregation_support import (
    HEADERS,
    assert_outputs_equal_the_monolithic_server,
    assert_same,
    completion,
    idle,
    prompt_of,
)
from tests.server_process import (
    Server,
    free_port,
    start_command,
    start_server,
    stop_server,
    wait_until_up,
)
from tests.tiny_model import STEP_DELAY_MS, tiny_server_flags

BLOCK_SIZE = 16  # the servers' default --block-size
HEARTBEAT = ("--disaggregation-heartbeat-interval", "0.5", "--disaggregation-heartbeat-max-failures", "3")
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "passive"}
HELD_BACK_MS = 3000  # the slow prefill instance's delay on every KV message: ample time to hang up or kill first


@dataclass(frozen=True)
class Model:
    """What the module's servers run, and what follows from it."""

    flags: tuple[str, ...]  # the servers' model flags
    block_bytes: int  # the KV of one block, float32
    # the bootstrap and waiting timeouts: long enough for a 2,047-token prefill at budget 64 on a loaded host
    timeout_s: int
    # CHUNKSERVE_TEST_STEP_DELAY_MS of the servers whose requests a test acts on mid-flight: a tiny
    # model's 2,047-token prefill is over before a stage can be observed; SmolLM2's steps are slow enough
    step_delay_ms: int


def kv_block_bytes(model_path: str | None) -> int:
    config = load_model_config(resolve_model(model_path))
    return KVLayout("float32", config.num_layers, config.num_kv_heads, config.head_dim, BLOCK_SIZE).block_bytes


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def model(request) -> Model:
    if request.param == "tiny":
        path = request.getfixturevalue("tiny_gguf")
        return Model(tuple(tiny_server_flags(path)), kv_block_bytes(path), timeout_s=8, step_delay_ms=STEP_DELAY_MS)
    return Model((), kv_block_bytes(None), timeout_s=30, step_delay_ms=0)


@dataclass
class Router:
    server: Server  # `chunkserve router` as the harness started it

    @property
    def process(self) -> subprocess.Popen:
        return self.server.process

    @property
    def base_url(self) -> str:
        return self.server.base_url

    def post(self, path: str, body: dict, **kwargs) -> httpx.Response:
        return httpx.post(self.base_url + path, json=body, headers=HEADERS, timeout=180, **kwargs)


def start_router(prefill: Server, bootstrap_port: int, decode: Server, tmp_path_factory, name: str) -> Router:
    """Up once its /health answers 200: it has seen both instances healthy."""
    return Router(start_command(tmp_path_factory, [
        sys.executable, "-m", "chunkserve.entrypoints.cli", "router", "--pd-disaggregation", "--prefill",
        prefill.base_url, str(bootstrap_port), "--decode", decode.base_url, "--health-check-interval", "0.5"],
        name=name))


def stop_router(router: Router) -> None:
    router.server.service.stop(grace_s=30)


@dataclass
class Pair:
    """A prefill and a decode instance, and the monolithic server of the same budget."""

    prefill: Server
    bootstrap_port: int
    decode: Server
    mono: Server
    router: Router | None = None

    def direct(self, path: str, body: dict, decode: Server | None = None,
               prefill: tuple[Server, int] | None = None) -> tuple[httpx.Response, httpx.Response]:
        """Pair a request by hand (as the router does): both halves at once; (prefill, decode) answers."""
        prefill_server, port = prefill or (self.prefill, self.bootstrap_port)
        paired = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": port,
                  "bootstrap_room": random.getrandbits(63)}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, prefill_server.base_url + path, json=paired, headers=HEADERS, timeout=180)
            second = pool.submit(httpx.post, (decode or self.decode).base_url + path, json=paired, headers=HEADERS,
                                 timeout=180)
            return first.result(), second.result()


def start_instance(tmp_path_factory, model: Model, *flags: str, name: str, env: dict | None = None,
                   wait: bool = True) -> Server:
    """A server of this module: one OpenMP thread each, so that several computing at once on the host's cores
    never oversubscribe them (a spinning OpenMP team on a shared core slows every op by orders of
    magnitude), and all of them compute alike (the same thread count, the same sums)."""
    return start_server(tmp_path_factory, *model.flags, *flags, name=name, env={**ONE_THREAD, **(env or {})},
                        wait=wait)


def start_prefill(tmp_path_factory, model: Model, name: str, *flags: str,
                  env: dict | None = None) -> tuple[Server, int]:
    """A prefill instance (not yet up: `wait_until_up`) and its bootstrap port."""
    port = free_port()
    prefill = start_instance(tmp_path_factory, model, "--disaggregation-mode", "prefill",
                             "--disaggregation-bootstrap-port", str(port), *flags, name=f"{name}-prefill", env=env,
                             wait=False)
    return prefill, port


def kill_instance(server: Server) -> None:
    """SIGKILL of a whole instance: the engine-core process the server spawned, then the server
    (an engine core left alone would notice its server gone and shut down gracefully, still
    sending the KV it holds)."""
    pid = server.process.pid
    tasks = pathlib.Path(f"/proc/{pid}/task")
    children = [int(child) for task in tasks.iterdir() for child in (task / "children").read_text().split()]
    for process_id in (*children, pid):
        os.kill(process_id, signal.SIGKILL)
    server.process.wait()


def decode_steps(server: Server) -> int:
    with server.admin_client() as http:
        return len(http.get("/debug/steps", params={"last": 100_000}).json()["steps"])


def transfer_bytes(server: Server) -> float:
    return server.metrics().get("chunkserve:kv_transfer_bytes_total{}", 0.0)


def transfers(server: Server) -> float:
    """Requests whose KV transfer finished."""
    return server.metrics().get("chunkserve:kv_transfer_requests_total{}", 0.0)


def late_messages(server: Server) -> float:
    return server.metrics().get("chunkserve:kv_transfer_late_messages_total{}", 0.0)


def start_pair(tmp_path_factory, model: Model, decode: Server, budget: int, prefill_env: dict | None = None
               ) -> tuple[Pair, list[Server]]:
    """A monolithic server and a prefill instance of `budget`, both started (not yet up), paired
    with `decode`; the pair and its new servers."""
    flags = ("--max-num-batched-tokens", str(budget))
    mono = start_instance(tmp_path_factory, model, *flags, name=f"mono{budget}", wait=False)
    prefill, port = start_prefill(tmp_path_factory, model, f"p{budget}", *flags,
                                  "--disaggregation-bootstrap-timeout", str(model.timeout_s), env=prefill_env)
    return Pair(prefill, port, decode, mono), [mono, prefill]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model):
    """Budget 64: a monolithic server and a prefill instance, a decode instance and a router,
    started together (the model loads in parallel). The decode and prefill instances step with
    the model's test step delay: the tests that act mid-prefill or mid-decode use them (the
    monolithic server, only compared with, steps at full speed)."""
    servers, router = [], None
    delayed = {TEST_STEP_DELAY_ENV: str(model.step_delay_ms)}
    try:
        decode = start_instance(tmp_path_factory, model, "--disaggregation-mode", "decode", *HEARTBEAT,
                                "--disaggregation-waiting-timeout", str(model.timeout_s), name="decode",
                                env=delayed, wait=False)
        servers.append(decode)
        pair, started = start_pair(tmp_path_factory, model, decode, 64, prefill_env=delayed)
        servers += started
        for server in servers:
            wait_until_up(server)
        pair.router = router = start_router(pair.prefill, pair.bootstrap_port, decode, tmp_path_factory, "router64")
        yield {64: pair}
    finally:
        if router is not None:
            stop_router(router)
        for server in servers:
            stop_server(server)


@pytest.fixture(scope="module")
def pair256(tmp_path_factory, model, cluster):
    """Budget 256's monolithic server and prefill instance, with the cluster's decode instance
    (its chunks are other chunks: the long tier's equality and layout checks)."""
    pair, servers = start_pair(tmp_path_factory, model, cluster[64].decode, 256)
    try:
        for server in servers:
            wait_until_up(server)
        pair.router = start_router(pair.prefill, pair.bootstrap_port, pair.decode, tmp_path_factory, "router256")
        yield pair
    finally:
        if pair.router is not None:
            stop_router(pair.router)
        for server in servers:
            stop_server(server)


@pytest.mark.parametrize("budget", [64, pytest.param(256, marks=pytest.mark.slow)])  # 256 in the long tier
def test_outputs_equal_the_monolithic_server(cluster, budget, request):
    pair = cluster[64] if budget == 64 else request.getfixturevalue("pair256")
    assert_outputs_equal_the_monolithic_server(pair.mono, pair.router.post)
    idle(pair.prefill, pair.decode)


def test_a_streamed_answer_equals_the_monolithic_one(cluster):
    pair = cluster[64]
    body = {"prompt": prompt_of(100, 99), "max_tokens": 12, "temperature": 0, "stream": True}

    def text_of(response: httpx.Response) -> tuple[str, str]:
        events = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        return "".join(e["choices"][0]["text"] for e in events), events[-1]["choices"][0]["finish_reason"]

    mono = httpx.post(pair.mono.base_url + "/v1/completions", json=body, headers=HEADERS, timeout=180)
    assert text_of(pair.router.post("/v1/completions", body)) == text_of(mono)


def test_prefix_cache_hits_on_either_side_give_the_same_tokens_and_send_only_the_delta(cluster, model):
    """A hit on the decode side's prefix cache means only the blocks it lacks travel; a hit on the
    prefill side is reported as the request's cached tokens; either way, the monolithic tokens."""
    pair = cluster[64]
    prompt = prompt_of(300, 300)  # 19 blocks; the decode side can cache 18 (never the last token's)
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1}
    mono = httpx.post(pair.mono.base_url + "/v1/completions", json=body, headers=HEADERS, timeout=180)

    def run(expect_blocks: int, expect_cached: int) -> None:
        before = transfer_bytes(pair.decode)
        answer = pair.router.post("/v1/completions", body)
        assert_same(mono, answer)
        assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == expect_cached
        assert pair.decode.wait_until(lambda m: m["chunkserve:kv_transfer_bytes_total{}"] > before)[
            "chunkserve:kv_transfer_bytes_total{}"] - before == expect_blocks * model.block_bytes

    def reset(server: Server) -> None:
        with server.admin_client() as http:
            assert http.post("/reset_prefix_cache").status_code == 200

    reset(pair.prefill)
    reset(pair.decode)
    run(expect_blocks=19, expect_cached=0)  # neither side caches it
    run(expect_blocks=1, expect_cached=288)  # both
    reset(pair.prefill)
    run(expect_blocks=1, expect_cached=0)  # the decode side only
    reset(pair.decode)
    run(expect_blocks=19, expect_cached=288)  # the prefill side only


def test_the_decode_pool_holds_the_kv_the_monolithic_server_computes(cluster):
    """KV bytes of the prompt's full blocks in the decode instance's pool (exported mid-decode) are
    the monolithic server's, byte for byte: what the prefill side computed arrived unchanged."""
    pair = cluster[64]

    def exported_blocks(url: str, server: Server, rid: str) -> list[bytes]:
        body = {"input_ids": prompt_of(200, 2000), "rid": rid, "stream": True,
                "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}}
        with httpx.stream("POST", url + "/generate", json=body, headers=HEADERS, timeout=180) as response:
            lines = response.iter_lines()  # kept: a closed iterator would close the stream (an abort)
            for line in lines:
                if line.startswith("data: "):
                    break
            with server.admin_client() as http:
                data = http.post("/export_request", params={"rid": rid, "mode": "copy"}).content
        snapshot = RequestSnapshot.from_bytes(data)
        return [block.payload for block in snapshot.blocks[: 200 // 16]]

    mono_blocks = exported_blocks(pair.mono.base_url, pair.mono, "kv-mono")
    assert exported_blocks(pair.router.base_url, pair.decode, "kv-pd") == mono_blocks
    idle(pair.prefill, pair.decode, pair.mono)


def test_first_token_finishes_take_no_decode_step(cluster):
    """EOS as the first token, a stop string the first token completes, max_tokens=1: one token
    (or none shown), the right finish reason, and the decode instance runs no step for the ones its
    engine core decides (EOS, max_tokens); steps are counted once it is idle, when every step it
    ran has been recorded."""
    pair = cluster[64]
    prompt = prompt_of(50, 50)
    first = httpx.post(pair.mono.base_url + "/generate", headers=HEADERS, timeout=60, json={
        "input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).json()["text"]
    eos = 2  # SmolLM2's <|im_end|>
    cases = [({"max_tokens": 1}, "length", first), ({"logit_bias": {str(eos): 100}}, "stop", ""),
             ({"stop": [first]} if first.strip() else {"max_tokens": 1}, "stop" if first.strip() else "length",
              "" if first.strip() else first)]
    for extra, reason, text in cases:
        steps = decode_steps(pair.decode)
        answer = pair.router.post("/v1/completions", {"prompt": prompt, "temperature": 0, "max_tokens": 16, **extra})
        choice = answer.json()["choices"][0]
        assert (choice["finish_reason"], choice["text"]) == (reason, text), extra
        assert answer.json()["usage"]["completion_tokens"] <= 1
        idle(pair.prefill, pair.decode)
        stepped = decode_steps(pair.decode) - steps
        if "stop" in extra:
            # A stop string is matched on text by the decode side's frontend, which then aborts the
            # request in the engine core (core/stop.py): the core may run the one step it scheduled
            # before the abort lands, never more.
            assert stepped <= 1, f"the decode instance stepped {stepped} times for {extra}"
        else:
            assert stepped == 0, f"the decode instance stepped for {extra}"


def stream_until(router: Router, body: dict, condition, timeout_s: float = 60.0) -> None:
    """Stream a request through the router (reading nothing) and hang up once `condition()` holds."""
    deadline = time.monotonic() + timeout_s
    with httpx.stream("POST", router.base_url + "/v1/completions", json=body, headers=HEADERS,
                      timeout=180) as response:
        assert response.status_code == 200
        while not condition():
            assert time.monotonic() < deadline, "the condition never held"
            time.sleep(0.02)


def stream_some_tokens(router: Router, body: dict, count: int) -> list[dict]:
    """Stream a request through the router and hang up after its first `count` events; returns them."""
    events = []
    with httpx.stream("POST", router.base_url + "/v1/completions", json=body, headers=HEADERS,
                      timeout=180) as response:
        lines = response.iter_lines()  # kept: a closed iterator would close the stream before we mean to
        for line in lines:
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == count:
                    break
    return events


# a fixed prompt per stage (str hashes are salted per process: a prompt from one would change every run)
STAGE_SEEDS = {"prefilling": 11, "between_chunks": 12}


@pytest.mark.parametrize("stage", ["prefilling", "between_chunks", "decoding"])
def test_an_abort_at_any_stage_gives_every_block_back(cluster, stage):
    """A client hanging up while the prefill computes, after some blocks reached the decode side,
    or while the decode side decodes: both instances go back to no request and all their blocks,
    and a new request on the freed blocks decodes exactly like the monolithic server. Each stage
    is asserted reached: the prefill instance running it or blocks arrived, and the transfer not
    finished when the client left; or tokens streamed and no finish."""
    pair = cluster[64]
    transfers_before = transfers(pair.decode)
    if stage == "decoding":
        events = stream_some_tokens(pair.router, {"prompt": prompt_of(100, 5), "max_tokens": 64, "temperature": 0,
                                                  "stream": True, "ignore_eos": True}, count=6)
        assert len(events) == 6 and all(e["choices"][0]["finish_reason"] is None for e in events), events
        transfers_after = transfers_before + 1  # its KV had all arrived: it was decoding
    else:
        body = {"prompt": prompt_of(2047, STAGE_SEEDS[stage]), "max_tokens": 64, "temperature": 0, "stream": True,
                "ignore_eos": True}
        if stage == "prefilling":
            stream_until(pair.router, body, lambda: pair.prefill.metrics()["chunkserve:num_requests_running{}"] >= 1)
        else:
            bytes_before = transfer_bytes(pair.decode)
            stream_until(pair.router, body, lambda: transfer_bytes(pair.decode) > bytes_before)
        transfers_after = transfers_before  # it left before its last block: no transfer finished
    idle(pair.prefill, pair.decode)
    assert transfers(pair.decode) == transfers_after
    probe = {"prompt": prompt_of(600, 600), "max_tokens": 8, "temperature": 0, "logprobs": 1}
    mono = httpx.post(pair.mono.base_url + "/v1/completions", json=probe, headers=HEADERS, timeout=180)
    assert_same(mono, pair.router.post("/v1/completions", probe))
    idle(pair.prefill, pair.decode)


def _prefill_with_faults(tmp_path_factory, model: Model, name: str, env: dict[str, str]):
    """A prefill instance with fault injection, up only while the test that needs it runs (each
    instance is a model's worth of memory)."""
    server, port = start_prefill(tmp_path_factory, model, name, env=env)
    try:
        yield wait_until_up(server), port
    finally:
        stop_server(server)


@pytest.fixture
def corrupting_prefill(tmp_path_factory, model):
    """Every KV message corrupted."""
    yield from _prefill_with_faults(tmp_path_factory, model, "corrupt", {"CHUNKSERVE_PD_FAIL_PROB": "1"})


@pytest.fixture
def flaky_prefill(tmp_path_factory, model):
    """5% of KV messages corrupted."""
    yield from _prefill_with_faults(tmp_path_factory, model, "flaky", {"CHUNKSERVE_PD_FAIL_PROB": "0.05",
                                                                       "CHUNKSERVE_PD_FAULT_SEED": "5"})


@pytest.fixture(scope="module")
def slow_prefill(tmp_path_factory, model):
    """Every message held back HELD_BACK_MS (the last test using it kills it)."""
    yield from _prefill_with_faults(tmp_path_factory, model, "slow", {"CHUNKSERVE_PD_DELAY_MS": str(HELD_BACK_MS)})


def test_a_corrupted_chunk_aborts_the_request_and_caches_nothing(cluster, model, corrupting_prefill):
    pair = cluster[64]
    prompt = prompt_of(120, 4242)
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1}
    _, answer = pair.direct("/v1/completions", body, prefill=corrupting_prefill)
    assert answer.status_code == 503 and answer.headers["retry-after"]
    assert "crc32" in answer.json()["error"]["message"]
    _, streamed = pair.direct("/v1/completions", {**body, "stream": True}, prefill=corrupting_prefill)
    events = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "abort"
    idle(pair.decode, corrupting_prefill[0])
    before = transfer_bytes(pair.decode)  # the corrupted KV was never registered: all 8 blocks travel again
    mono = httpx.post(pair.mono.base_url + "/v1/completions", json=body, headers=HEADERS, timeout=180)
    assert_same(mono, pair.router.post("/v1/completions", body))
    assert pair.decode.wait_until(lambda m: m["chunkserve:kv_transfer_bytes_total{}"] > before)[
        "chunkserve:kv_transfer_bytes_total{}"] - before == 8 * model.block_bytes


@pytest.mark.slow  # the long tier (every CI run); every tier fails a request's chunks (the corrupted-chunk test)
def test_five_percent_failed_chunks_over_200_requests_lose_nothing(cluster, flaky_prefill):
    """Every request ends, answered or with a 503, well within the waiting timeout; both sides
    end idle with every block back; the decode instance counts the failures."""
    pair = cluster[64]
    failed_before = pair.decode.metrics().get("chunkserve:kv_transfer_failed_total{}", 0)

    def one(index: int) -> int:
        body = {"prompt": prompt_of(17 + index % 16, 10_000 + index), "max_tokens": 2, "temperature": 0}
        return pair.direct("/v1/completions", body, prefill=flaky_prefill)[1].status_code

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        statuses = list(pool.map(one, range(200)))
    assert time.monotonic() - started < 120
    assert set(statuses) <= {200, 503} and statuses.count(503) > 0, statuses
    idle(pair.decode, flaky_prefill[0])
    failed = pair.decode.metrics()["chunkserve:kv_transfer_failed_total{}"] - failed_before
    assert failed == statuses.count(503)


def test_an_abort_after_the_last_chunk_before_the_decode_admits(cluster, slow_prefill, tmp_path_factory):
    """The prefill side computed everything and its messages are on their way (held back here)
    when the client hangs up: both sides end idle, and the decode side drops what arrives late
    (counted: the room's KV message and its final one at least)."""
    pair = cluster[64]
    slow, port = slow_prefill
    router = start_router(slow, port, pair.decode, tmp_path_factory, "router-slow-abort")
    try:
        late_before = late_messages(pair.decode)
        body = {"prompt": prompt_of(90, 90), "max_tokens": 8, "temperature": 0, "stream": True}
        stream_until(router, body, lambda: transfer_bytes(slow) > 0 and pair.decode.metrics()[
            "chunkserve:kv_transfer_requests_preallocated{}"] >= 1)
        idle(slow, pair.decode)
        # The decode side reads its sockets only while it steps: short requests keep it stepping
        # until the held-back messages have landed and been dropped.
        deadline = time.monotonic() + HELD_BACK_MS / 1000 + 60
        index = 0
        while late_messages(pair.decode) < late_before + 2:
            assert time.monotonic() < deadline, "the held-back messages never reached the decode instance"
            index += 1
            assert pair.router.post("/v1/completions", {"prompt": prompt_of(20, 900 + index), "max_tokens": 2,
                                                        "temperature": 0}).status_code == 200
        idle(slow, pair.decode)
        probe = {"prompt": prompt_of(90, 90), "max_tokens": 8, "temperature": 0, "logprobs": 1}
        mono = httpx.post(pair.mono.base_url + "/v1/completions", json=probe, headers=HEADERS, timeout=180)
        assert_same(mono, pair.router.post("/v1/completions", probe))
    finally:
        stop_router(router)


def test_a_killed_prefill_instance_fails_its_requests_within_the_heartbeat_window(cluster, model, slow_prefill,
                                                                                 tmp_path_factory):
    """SIGKILL of the prefill instance (server and engine core) while a request's KV is held back:
    the decode instance fails it for the lost connection (503), not by its waiting timeout, stays
    healthy and idle; the router answers 503 with Retry-After while no prefill instance is healthy."""
    pair = cluster[64]
    slow, port = slow_prefill
    router = start_router(slow, port, pair.decode, tmp_path_factory, "router-slow")
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(router.post, "/v1/completions",
                                  {"prompt": prompt_of(64, 64), "max_tokens": 8, "temperature": 0})
            pair.decode.wait_until(lambda m: m["chunkserve:kv_transfer_requests_preallocated{}"] >= 1)
            kill_instance(slow)
            killed = time.monotonic()
            answer = pending.result(timeout=60)
        assert answer.status_code == 503, answer.text
        # What failed it names the path: the connection (the decode side's: lost at once, or not
        # back within the heartbeat window; or the router's, whose HTTP request to the prefill
        # half dropped with the process), never the waiting timeout; a wall-clock bound within the
        # heartbeat window is one a loaded host could break, so the bound is the waiting timeout itself.
        message = answer.json()["error"]["message"]
        connection_lost = ("was lost", "cannot be reached", f"prefill instance {slow.base_url} could not be reached")
        assert any(phrase in message for phrase in connection_lost), message
        assert time.monotonic() - killed < model.timeout_s
        assert httpx.get(pair.decode.base_url + "/health").status_code == 200
        idle(pair.decode)
        deadline = time.monotonic() + 10
        while (health := httpx.get(router.base_url + "/health")).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert health.headers["retry-after"]
        refused = router.post("/v1/completions", {"prompt": "hello", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["retry-after"]
    finally:
        stop_router(router)


def test_a_half_that_never_meets_its_other_half_times_out_and_frees_its_blocks(cluster, model):
    """A decode half whose prefill half never arrives is aborted after the waiting timeout (503);
    a prefill half no decode side bootstraps gives its held blocks back after the bootstrap
    timeout. Both instances end idle."""
    pair = cluster[64]
    paired = {"prompt": prompt_of(70, 70), "max_tokens": 4, "temperature": 0, "bootstrap_host": "127.0.0.1",
              "bootstrap_port": pair.bootstrap_port}
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        decode_only = pool.submit(httpx.post, pair.decode.base_url + "/v1/completions", headers=HEADERS, timeout=120,
                                  json={**paired, "bootstrap_room": random.getrandbits(63)})
        prefill_only = pool.submit(httpx.post, pair.prefill.base_url + "/v1/completions", headers=HEADERS,
                                   timeout=120, json={**paired, "bootstrap_room": random.getrandbits(63)})
        answer = decode_only.result()
        assert prefill_only.result().status_code == 200  # its one token; its KV waits for a decode side
    assert answer.status_code == 503, answer.text
    assert f"did not arrive within {model.timeout_s} s" in answer.json()["error"]["message"]
    # at least the timeout (its clock starts after the request was sent); at most 15 s more for a loaded host
    assert model.timeout_s - 1 < time.monotonic() - started < model.timeout_s + 15
    idle(pair.decode)
    idle(pair.prefill, timeout_s=model.timeout_s + 15)


def test_a_plain_request_to_a_prefill_instance_is_refused(cluster):
    answer = httpx.post(cluster[64].prefill.base_url + "/v1/completions", headers=HEADERS,
                        json={"prompt": "hello", "max_tokens": 2})
    assert answer.status_code == 400
    assert "chunkserve router" in answer.json()["error"]["message"]


@pytest.fixture(scope="module")
def small_decode(tmp_path_factory, model, cluster):
    """A decode instance of 24 blocks (384 tokens) behind its own router."""
    small = start_instance(tmp_path_factory, model, "--disaggregation-mode", "decode", "--num-kv-blocks", "24",
                           "--max-model-len", "384", "--max-num-seqs", "8", name="decode-small")
    router = None
    try:
        pair = cluster[64]
        router = start_router(pair.prefill, pair.bootstrap_port, small, tmp_path_factory, "router-small")
        yield small, router
    finally:
        if router is not None:
            stop_router(router)
        stop_server(small)


def test_a_decode_pool_too_small_for_the_load_makes_requests_wait_and_all_finish(cluster, small_decode):
    small, router = small_decode
    pair = cluster[64]
    bodies = [{"prompt": prompt_of(100, 700 + i), "max_tokens": 60, "temperature": 0, "ignore_eos": True,
               "logprobs": 1} for i in range(6)]  # 10 blocks each: two fit at once
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda b: router.post("/v1/completions", b), bodies))
    # A request the full pool preempts recomputes its KV on the decode instance in other chunks,
    # which the default mode sums in another order (docs/DETERMINISM.md): its tokens stay the
    # monolithic server's, its logprobs within float32's oracle tolerance.
    for body, answer in zip(bodies, answers):
        assert_same(httpx.post(pair.mono.base_url + "/v1/completions", json=body, headers=HEADERS, timeout=180),
                    answer, logprob_tolerance=1e-4)
    idle(small, pair.prefill)


def test_a_request_larger_than_the_decode_pool_is_refused_at_admission(cluster, small_decode):
    small, router = small_decode
    answer = router.post("/v1/completions", {"prompt": prompt_of(300, 1), "max_tokens": 200})
    assert answer.status_code == 400
    assert "max_model_len" in answer.json()["error"]["message"]
    idle(small, cluster[64].prefill)


@pytest.mark.slow  # its own decode instance: the refusal is checked on every CI run, in the long tier
def test_a_different_kv_layout_is_refused_at_bootstrap(pair256, model, tmp_path_factory):
    other = start_instance(tmp_path_factory, model, "--disaggregation-mode", "decode", "--block-size", "32",
                           name="decode-bs32")
    pair = pair256
    try:
        _check_layout_refusal(pair, other)
    finally:
        stop_server(other)


def _check_layout_refusal(pair: Pair, other: Server) -> None:
    _, answer = pair.direct("/v1/completions", {"prompt": prompt_of(40, 3), "max_tokens": 4}, decode=other)
    assert answer.status_code == 503
    assert "block_size is 32 on the decode instance but 16 here" in answer.json()["error"]["message"]
    idle(other, pair.prefill)


def test_server_info_names_the_role_and_metrics_count_transfers(cluster):
    pair = cluster[64]
    info = httpx.get(pair.prefill.base_url + "/server_info").json()
    assert (info["disaggregation_mode"], info["disaggregation_bootstrap_port"]) == ("prefill", pair.bootstrap_port)
    assert httpx.get(pair.decode.base_url + "/server_info").json()["disaggregation_mode"] == "decode"
    metrics = pair.decode.metrics()
    assert metrics["chunkserve:kv_transfer_requests_total{}"] > 0
    with pair.decode.admin_client() as http:  # the step trace's records carry the bytes copied in
        steps = http.get("/debug/steps", params={"last": 100_000}).json()["steps"]
    assert sum(step["kv_transfer_bytes"] for step in steps) > 0
    transfers = metrics["chunkserve:kv_transfer_requests_total{}"]
    assert metrics["chunkserve:kv_transfer_latency_seconds_count{}"] == transfers


def test_a_disaggregated_instance_answers_404_to_vllms_version(cluster):
    """Routers take /version for a vLLM server and pair such instances by vLLM's protocol (SMG:
    the prefill request alone, then the decode one); these speak SGLang's, which /server_info tells."""
    pair = cluster[64]
    for server in (pair.prefill, pair.decode):
        answer = httpx.get(server.base_url + "/version")
        assert answer.status_code == 404 and "SGLang's prefill/decode protocol" in answer.json()["error"]["message"]
    assert httpx.get(pair.mono.base_url + "/version").status_code == 200


@pytest.mark.slow  # four servers of its own; the default tier checks the bits in process (test_llm_deterministic)
def test_deterministic_pairs_give_the_monolithic_servers_bits_at_another_budget(tmp_path_factory, tiny_gguf):
    """With --deterministic (and the default dtype) on every server, a prefill instance at budget
    32 and its decode instance give exactly the tokens and logprobs of a monolithic server at
    budget 256, greedy and seeded."""
    model = Model(tuple(tiny_server_flags(tiny_gguf)), 0, timeout_s=8, step_delay_ms=0)
    flags = ("--deterministic", "--dtype", "auto")
    mono = start_instance(tmp_path_factory, model, *flags, "--max-num-batched-tokens", "256", name="det-mono",
                          wait=False)
    decode = start_instance(tmp_path_factory, model, *flags, "--disaggregation-mode", "decode", name="det-decode",
                            wait=False)
    prefill, port = start_prefill(tmp_path_factory, model, "det", *flags, "--max-num-batched-tokens", "32")
    servers, router = [mono, decode, prefill], None
    try:
        for server in servers:
            wait_until_up(server)
        router = start_router(prefill, port, decode, tmp_path_factory, "det-router")
        for length in (1, 17, 100, 257):
            for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": length}):
                body = {"prompt": prompt_of(length, length), "max_tokens": 8, "logprobs": 2, **sampling}
                direct = httpx.post(mono.base_url + "/v1/completions", json=body, headers=HEADERS, timeout=180)
                routed = router.post("/v1/completions", body)
                assert completion(routed) == completion(direct)
    finally:
        if router is not None:
            stop_router(router)
        for server in servers:
            stop_server(server)

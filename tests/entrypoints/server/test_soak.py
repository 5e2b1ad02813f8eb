"""A soak: many streaming requests of mixed shapes, about 40% of them abandoned by their
clients (before the first byte or mid-stream), against one server on a tiny model. Then the
server must be back to idle: /metrics shows nothing running or waiting and no KV block in
use, and the admin `GET /debug/check` says every block is free or cached and no request is
left in the engine.

Also: no response is a 5xx, every stream that was read to its end ended with a finish_reason
(length or stop, never abort or an error event) and `[DONE]`, a stream with ignore_eos
carried exactly max_tokens tokens, and the server logged no traceback.

The default run sends 300 requests (`test_short_soak`); `pytest -m slow` adds 2,000
(`test_full_soak`). SOAK_SEED picks another seeded mix.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.hostile_server import auth, check_engine_clean, server_log_tail, start_tiny_server, stream_error_events
from tests.server_process import stop_server

CONCURRENCY = 32
MAX_MODEL_LEN = 256
VOCAB = 49152
WORDS = ["the", "lighthouse", "keeper", "counted", "steps", "every", "night", "and", "listened", "to", "sea",
         "while", "ships", "passed", "slowly", "through", "fog", "under", "a", "pale", "moon"]


@pytest.fixture(scope="module")
def soak_server(tmp_path_factory):
    # 64 blocks of 16 tokens for up to 16 running requests of up to 256 tokens: about one
    # preemption per request, so aborts meet preempted and waiting requests too.
    started = start_tiny_server(tmp_path_factory, "--max-num-seqs", "16", "--num-kv-blocks", "64",
                                "--max-num-batched-tokens", "256", name="soak-server", max_model_len=MAX_MODEL_LEN)
    yield started
    stop_server(started)


@dataclass
class Plan:
    index: int
    path: str
    body: dict[str, Any]
    num_prompts: int
    max_tokens: int
    ignore_eos: bool
    disconnect: str  # "none", "before_first_byte" or "mid_stream"
    disconnect_after_s: float = 0.0
    disconnect_after_events: int = 0


@dataclass
class Outcome:
    plan: Plan
    status: int | None = None
    events: list[str] = field(default_factory=list)
    disconnected: bool = False
    error: str | None = None


def make_plans(count: int, seed: int) -> list[Plan]:
    rng = random.Random(seed)
    shared_prefixes = [[rng.randrange(100, VOCAB) for _ in range(48)] for _ in range(4)]

    def prompt_length() -> int:
        roll = rng.random()
        return rng.randint(1, 8) if roll < 0.4 else rng.randint(9, 64) if roll < 0.8 else rng.randint(65, 160)

    def token_prompt() -> list[int]:
        n = prompt_length()
        if rng.random() < 0.3:  # a shared prefix: the prefix cache gets hits, and blocks shared by aborted requests
            return (rng.choice(shared_prefixes) + [rng.randrange(100, VOCAB) for _ in range(n)])[:160]
        return [rng.randrange(100, VOCAB) for _ in range(n)]

    def text_prompt() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(max(1, prompt_length() * 3 // 4)))

    plans = []
    for index in range(count):
        max_tokens = rng.choice([1, 2, 4, 8, 16, 32, 64]) if rng.random() < 0.7 else rng.randint(1, 80)
        ignore_eos = rng.random() < 0.5
        sampling = {"temperature": rng.choice([0, 0.7, 1.0]), "ignore_eos": ignore_eos, "stream": True,
                    "seed": rng.randrange(2**31)}
        if rng.random() < 0.3:
            sampling["stream_options"] = {"include_usage": True}
        kind = rng.random()
        num_prompts = 1
        if kind < 0.30:
            path, body = "/v1/completions", {"prompt": text_prompt(), "max_tokens": max_tokens, **sampling}
        elif kind < 0.55:
            path, body = "/v1/completions", {"prompt": token_prompt(), "max_tokens": max_tokens, **sampling}
            if rng.random() < 0.3:
                body["logprobs"] = rng.randint(0, 5)
        elif kind < 0.65:
            num_prompts = rng.randint(2, 4)
            path, body = "/v1/completions", {"prompt": [token_prompt() for _ in range(num_prompts)],
                                             "max_tokens": max_tokens, **sampling}
        elif kind < 0.90:
            messages = [{"role": "user", "content": text_prompt()}]
            path, body = "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens, **sampling}
            if rng.random() < 0.3:
                body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
        else:
            sampling_params = {"max_new_tokens": max_tokens, "temperature": sampling["temperature"],
                               "ignore_eos": ignore_eos}
            path, body = "/generate", {"input_ids": token_prompt(), "sampling_params": sampling_params, "stream": True}
        roll = rng.random()
        disconnect = "before_first_byte" if roll < 0.2 else "mid_stream" if roll < 0.4 else "none"
        plans.append(Plan(index, path, body, num_prompts, max_tokens, ignore_eos, disconnect,
                          disconnect_after_s=rng.uniform(0.0, 0.05),
                          disconnect_after_events=rng.randint(1, max(1, max_tokens))))
    return plans


async def run_one(client: httpx.AsyncClient, plan: Plan) -> Outcome:
    outcome = Outcome(plan)

    async def read() -> None:
        async with client.stream("POST", plan.path, json=plan.body) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                outcome.events.append((await response.aread()).decode("utf-8", "replace"))
                return
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    outcome.events.append(line[len("data: "):])
                    if plan.disconnect == "mid_stream" and len(outcome.events) >= plan.disconnect_after_events:
                        outcome.disconnected = True
                        return  # leaving the block closes the connection mid-stream

    try:
        if plan.disconnect == "before_first_byte":
            try:
                await asyncio.wait_for(read(), timeout=plan.disconnect_after_s)
            except asyncio.TimeoutError:
                pass
            outcome.disconnected = True  # even if it finished first: nothing is checked of it
        else:
            await read()
    except httpx.HTTPError as error:
        outcome.error = repr(error)
    return outcome


async def run_soak(base_url: str, plans: list[Plan]) -> list[Outcome]:
    semaphore = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=base_url, headers=auth(), timeout=120, limits=limits) as client:

        async def bounded(plan: Plan) -> Outcome:
            async with semaphore:
                return await run_one(client, plan)

        return await asyncio.gather(*(bounded(plan) for plan in plans))


def problems_of_completed(outcome: Outcome) -> list[str]:
    """What is wrong with a stream that was read to its end."""
    plan, events = outcome.plan, outcome.events
    where = f"request {plan.index} ({plan.path}, {plan.num_prompts} prompt(s), max_tokens {plan.max_tokens})"
    if outcome.error:
        return [f"{where}: {outcome.error}"]
    if outcome.status != 200:
        return [f"{where}: HTTP {outcome.status}: {events[:1]}"]
    problems = []
    errors = stream_error_events(events)
    if errors:
        problems.append(f"{where}: error events {errors}")
    if not events or events[-1] != "[DONE]":
        problems.append(f"{where}: the stream did not end with [DONE]: {events[-2:]}")
    payloads = [json.loads(e) for e in events if e != "[DONE]" and not e.startswith('{"error"')]
    finishes: dict[int, str] = {}
    tokens: Counter = Counter()
    if plan.path == "/generate":
        if payloads:
            last = payloads[-1]
            reason = (last["meta_info"].get("finish_reason") or {}).get("type")
            finishes[0] = reason
            tokens[0] = len(last["output_ids"])
    else:
        for payload in payloads:
            for choice in payload.get("choices", []):
                if choice.get("finish_reason"):
                    finishes[choice["index"]] = choice["finish_reason"]
                if plan.path == "/v1/completions" or choice.get("delta", {}).get("role") is None:
                    tokens[choice["index"]] += 1
    for index in range(plan.num_prompts):
        reason = finishes.get(index)
        if reason not in ("length", "stop"):
            problems.append(f"{where}: prompt {index} finished with {reason!r}")
        elif plan.ignore_eos and (reason != "length" or tokens[index] != plan.max_tokens):
            problems.append(f"{where}: prompt {index} ended {reason} after {tokens[index]} tokens")
    return problems


def metrics_idle(m: dict[str, float]) -> bool:
    return (m["chunkserve:num_requests_running{}"] == 0 and m["chunkserve:num_requests_waiting{}"] == 0
            and m["chunkserve:kv_cache_usage_perc{}"] == 0)


def soak(server, count: int, seed: int) -> None:
    plans = make_plans(count, seed)
    preemptions = server.metrics()["chunkserve:num_preemptions_total{}"]
    started = time.monotonic()
    outcomes = asyncio.run(run_soak(server.base_url, plans))
    elapsed = time.monotonic() - started
    preemptions = server.metrics()["chunkserve:num_preemptions_total{}"] - preemptions

    statuses = Counter(o.status for o in outcomes)
    server_errors = [o for o in outcomes if o.status is not None and o.status >= 500]
    completed = [o for o in outcomes if not o.disconnected]
    problems = [p for o in completed for p in problems_of_completed(o)]
    print(f"\nsoak: {count} requests in {elapsed:.1f}s, {len(completed)} read to the end, "
          f"{count - len(completed)} disconnected, {preemptions:.0f} preemptions, statuses {dict(statuses)}, "
          f"{len(problems)} problems")

    assert not server_errors, f"{len(server_errors)} 5xx answers, e.g. {server_errors[0].events[:1]}"
    assert not problems, f"{len(problems)} completed streams went wrong:\n" + "\n".join(problems[:30])
    try:
        server.wait_until(metrics_idle, timeout_s=30)
    except AssertionError:
        m = server.metrics()
        raise AssertionError("the server did not go back to idle: running "
                             f"{m['chunkserve:num_requests_running{}']}, waiting "
                             f"{m['chunkserve:num_requests_waiting{}']}, KV usage "
                             f"{m['chunkserve:kv_cache_usage_perc{}']}") from None
    check_engine_clean(server)
    health = httpx.get(f"{server.base_url}/health", timeout=10)
    assert health.status_code == 200
    log = server_log_tail(server, chars=10**7)
    assert "Traceback" not in log, f"the server logged tracebacks:\n{log[log.index('Traceback'):][:3000]}"


def test_short_soak(soak_server):
    soak(soak_server, 300, int(os.environ.get("SOAK_SEED", "1")))


@pytest.mark.slow
def test_full_soak(soak_server):
    soak(soak_server, 2000, int(os.environ.get("SOAK_SEED", "2")))

"""`--deterministic` served: 200 identical requests under random concurrency (1-16) and arrival
gaps get one answer, greedy and seeded at temperature 0.8; without the mode (long tier) the same
load's count of distinct answers is reported (printed), not asserted."""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import pytest

from chunkserve.bench.identical import send_waves
from tests.server_process import API_KEY, start_server, stop_server
from tests.tiny_model import TINY_SERVER_ENV, tiny_server_flags

REQUESTS = 200
BODIES = {"greedy": {"temperature": 0.0}, "seeded 0.8": {"temperature": 0.8, "seed": 11}}


def distinct_answers(server, body: dict) -> int:
    request = {"prompt": "Once upon a time there was", "max_tokens": 8,
               "ignore_eos": True, **body}
    texts = asyncio.run(send_waves(server.base_url, request, REQUESTS, 16, 5.0, np.random.default_rng(3),
                                   {"Authorization": f"Bearer {API_KEY}"}))
    return len(Counter(texts))


# the default mode's count is a report, not a check: the long tier prints it (and BENCHMARKS.md has SmolLM2's)
@pytest.mark.slow
@pytest.mark.parametrize("deterministic", [True, False],
                         ids=["deterministic", "default"])
def test_identical_requests_under_random_load_get_one_answer(tmp_path_factory, tiny_gguf, deterministic):
    flags = [*tiny_server_flags(tiny_gguf), "--dtype", "auto", "--max-num-batched-tokens", "32"]
    server = start_server(tmp_path_factory, *flags, *(["--deterministic"] if deterministic else []),
                          name="deterministic" if deterministic else "default", env=TINY_SERVER_ENV)
    try:
        with server.client() as client:
            assert client.get("/get_server_info").json()["deterministic"] is deterministic
        counts = {name: distinct_answers(server, body) for name, body in BODIES.items()}
    finally:
        stop_server(server)
    print(f"distinct answers of {REQUESTS} identical requests, {'with' if deterministic else 'without'} "
          f"--deterministic: {counts}")
    if deterministic:
        assert counts == dict.fromkeys(BODIES, 1)

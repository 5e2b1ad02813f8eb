"""Identical requests under changing load: the determinism benchmark's and test's driver.

Sends `n` copies of one completion request in waves: each wave has a random number of requests
(1 to `max_concurrency`) that arrive with random gaps and run together, and ends before the next
starts, so each copy shares its steps with a different batch, has its prompt cut into different
chunks and finds a different share of it in the prefix cache. Counting the distinct answers says
whether the server's numerics depend on its load (vLLM #23138, llama.cpp #7052)."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np

REQUEST_TIMEOUT_S = 600


async def send_waves(url: str, body: dict, n: int, max_concurrency: int, max_gap_ms: float,
                     rng: np.random.Generator, headers: dict[str, str] | None = None) -> list[str]:
    """`n` copies of `body` to `url`/v1/completions in waves; the completion texts."""
    texts: list[str] = []
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=REQUEST_TIMEOUT_S) as client:
        async def one(delay_s: float) -> str:
            await asyncio.sleep(delay_s)
            response = await client.post("/v1/completions", json=body)
            response.raise_for_status()
            return response.json()["choices"][0]["text"]

        while len(texts) < n:
            size = min(int(rng.integers(1, max_concurrency + 1)), n - len(texts))
            arrivals = np.cumsum(rng.uniform(0, max_gap_ms / 1000, size))
            texts += await asyncio.gather(*(one(float(t)) for t in arrivals))
    return texts

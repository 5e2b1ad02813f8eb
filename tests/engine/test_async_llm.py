"""AsyncLLM: the engine on its own thread, driven from asyncio."""

from __future__ import annotations

import asyncio

import pytest

from chunkserve import InvalidRequestError, SamplingParams
from chunkserve.engine.async_llm import AsyncLLM
from chunkserve.errors import ServerOverloadedError

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture
def async_llm(default_llm):
    """An AsyncLLM over the shared engine; the engine is back to the offline API afterwards."""
    engine = AsyncLLM(default_llm.engine)
    yield engine
    engine.shutdown()
    assert not engine.is_running
    kv = default_llm.engine.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_streams_one_output_per_token_with_the_offline_text(async_llm, default_llm):
    expected = default_llm.generate("Hello there", GREEDY)[0].outputs[0]

    async def run():
        stream = await async_llm.add_request("a", "Hello there", GREEDY)
        return [output async for output in stream]

    outputs = asyncio.run(run())
    assert [len(o.outputs[0].new_token_ids) for o in outputs] == [1] * 8
    assert [o.finished for o in outputs] == [False] * 7 + [True]
    assert "".join(o.outputs[0].text_delta for o in outputs) == expected.text
    assert outputs[-1].outputs[0].token_ids == expected.token_ids


def test_invalid_requests_raise_before_streaming(async_llm):
    async def run():
        with pytest.raises(InvalidRequestError, match="prompt is empty"):
            await async_llm.add_request("empty", "", GREEDY)
        with pytest.raises(InvalidRequestError, match="stop_token_ids must be below"):
            await async_llm.add_request("bad-stop", "Hi", SamplingParams(stop_token_ids=[10**9]))

    asyncio.run(run())


def test_overload_is_refused(default_llm):
    engine = AsyncLLM(default_llm.engine, max_waiting_requests=0)
    try:
        async def run():
            with pytest.raises(ServerOverloadedError, match="already waiting"):
                await engine.add_request("crowded", "Hi", GREEDY)

        asyncio.run(run())
    finally:
        engine.shutdown()


def test_leaving_a_stream_early_aborts_the_request(async_llm, default_llm):
    async def run():
        stream = await async_llm.add_request("long", "Tell me a story", SamplingParams(max_tokens=500))
        async for output in stream:
            if len(output.outputs[0].token_ids) == 3:
                break
        await asyncio.sleep(0.5)  # the abort command runs at the next step boundary

    asyncio.run(run())
    assert default_llm.engine.get_stats().num_running == 0


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(async_llm, default_llm, monkeypatch):
    runner = default_llm.engine.runner
    real_execute = runner.execute
    calls = []

    def execute_failing_once(output):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected fault")
        return real_execute(output)

    monkeypatch.setattr(runner, "execute", execute_failing_once)

    async def run():
        stream = await async_llm.add_request("victim", "Hello", GREEDY)
        with pytest.raises(RuntimeError, match="injected fault"):
            async for _ in stream:
                pass
        survivor = await async_llm.add_request("survivor", "Hello", GREEDY)
        return [output async for output in survivor][-1]

    final = asyncio.run(run())
    assert final.finished and len(final.outputs[0].token_ids) == 8

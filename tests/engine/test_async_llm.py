"""AsyncLLM: the engine core on a thread or in a process of its own, driven from asyncio. Streams,
aborts, faults and kills are behaviour: they run on the tiny GGUF (tests/tiny_model.py), with
SmolLM2's tokenizer and outputs compared between configurations of the same model."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time

import pytest

from chunkserve import LLM, InvalidRequestError, SamplingParams
from chunkserve.config import EngineArgs, resolve_model
from chunkserve.core.messages import EngineCoreOutput
from chunkserve.core.stats import SchedulerStats
from chunkserve.engine.async_llm import AsyncLLM
from chunkserve.engine.core import TEST_STEP_DELAY_ENV
from chunkserve.engine.detokenizer import IncrementalDetokenizer
from chunkserve.engine.messages import AbortRequests, Accepted, AddRequest, EngineCoreOutputs, EngineInfo
from chunkserve.errors import EngineDeadError, RequestAbortedError, ServerOverloadedError
from chunkserve.sampling_params import RequestOutputKind
from tests.tiny_model import STEP_DELAY_MS

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def tiny_engine_args(tiny_gguf: str, **overrides) -> dict:
    """The budget of conftest's default_llm, on the tiny model."""
    return dict(model=tiny_gguf, max_model_len=4096, max_num_batched_tokens=64, kv_cache_memory_gb=0.25,
                max_num_seqs=32) | overrides


@pytest.fixture(scope="module")
def tiny_llm(tiny_gguf):
    """One in-process engine on the tiny model, shared by this module's thread-side tests."""
    return LLM(dtype="float32", **tiny_engine_args(tiny_gguf))


@pytest.fixture
def async_llm(tiny_llm):
    """An AsyncLLM over the shared engine; the engine is back to the offline API afterwards."""
    engine = AsyncLLM.from_engine(tiny_llm.engine)
    yield engine
    engine.shutdown()
    assert not engine.is_running
    kv = tiny_llm.engine.engine_core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_streams_one_output_per_token_with_the_offline_text(async_llm, tiny_llm):
    expected = tiny_llm.generate("Hello there", GREEDY)[0].outputs[0]

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


def test_overload_is_refused(tiny_llm):
    engine = AsyncLLM.from_engine(tiny_llm.engine, max_waiting_requests=0)
    try:
        async def run():
            with pytest.raises(ServerOverloadedError, match="already waiting"):
                await engine.add_request("crowded", "Hi", GREEDY)

        asyncio.run(run())
    finally:
        engine.shutdown()


def test_leaving_a_stream_early_aborts_the_request(async_llm, tiny_llm, monkeypatch):
    # Slow steps: the 500 tokens outlast the abort by construction, so "finished" is the abort.
    monkeypatch.setattr(tiny_llm.engine.engine_core, "_test_step_delay_s", STEP_DELAY_MS / 1000)
    aborted = threading.Event()  # set by the update that reports the abort
    async_llm.observers.append(
        lambda record, outputs, stats: any(o.request_id == "long" and o.finished for o in outputs) and aborted.set())

    async def run():
        stream = await async_llm.add_request("long", "Tell me a story", SamplingParams(max_tokens=500))
        async for output in stream:
            if len(output.outputs[0].token_ids) == 3:
                break

    asyncio.run(run())
    assert aborted.wait(30)
    assert tiny_llm.engine.get_stats().num_running == 0


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(async_llm, tiny_llm, monkeypatch):
    executor = tiny_llm.engine.engine_core.executor
    real_execute = executor.execute_model
    calls = []

    def execute_failing_once(output):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected fault")
        return real_execute(output)

    monkeypatch.setattr(executor, "execute_model", execute_failing_once)

    async def run():
        stream = await async_llm.add_request("victim", "Hello", GREEDY)
        with pytest.raises(RuntimeError, match="injected fault"):
            async for _ in stream:
                pass
        survivor = await async_llm.add_request("survivor", "Hello", GREEDY)
        return [output async for output in survivor][-1]

    final = asyncio.run(run())
    assert final.finished and len(final.outputs[0].token_ids) == 8


def test_a_reader_that_stops_reading_is_aborted_and_what_it_left_is_dropped(tiny_llm):
    engine = AsyncLLM.from_engine(tiny_llm.engine, max_unread_outputs=4)
    params = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    try:
        async def run():
            stream = await engine.add_request("unread", "Tell me a story", params)
            while tiny_llm.engine.get_stats().num_running or engine.num_unread_aborts == 0:
                await asyncio.sleep(0.05)  # the reader reads nothing meanwhile
            with pytest.raises(RequestAbortedError, match="4 of its outputs were left unread"):
                async for _ in stream:
                    pass

        asyncio.run(run())
        assert engine.num_unread_aborts == 1
    finally:
        engine.shutdown()


def test_a_cache_salt_keeps_prefixes_apart(async_llm):
    prompt = [2000 + i for i in range(70)]  # 4 full blocks of 16
    params = SamplingParams(max_tokens=1, temperature=0)

    async def cached(request_id: str, salt: str | None) -> int:
        stream = await async_llm.add_request(request_id, prompt, params, cache_salt=salt)
        return [o async for o in stream][-1].num_cached_tokens

    async def run():
        return [await cached("a1", "tenant-a"), await cached("a2", "tenant-a"), await cached("b", "tenant-b"),
                await cached("none", None)]

    assert asyncio.run(run()) == [0, 64, 0, 0]


def test_a_long_prompt_is_tokenized_off_the_event_loop(async_llm, monkeypatch):
    """Tokenizing a prompt of ~128K characters takes a while: the loop keeps serving other tasks
    meanwhile. Counted as ticks of another task stamped while the tokenization ran: on the loop
    itself there could be none, however fast or slow the host (a bound on the longest gap could
    be broken by any hiccup of a shared host)."""
    prompt = "All work and no play makes Jack a dull boy. " * 2900  # under --max-prompt-chars (32 per position)
    process, tokenizing = async_llm.input_processor.process, []

    def timed_process(*args, **kwargs):
        started = time.monotonic()  # the clock of asyncio's loop.time()
        try:
            return process(*args, **kwargs)
        finally:
            tokenizing.append((started, time.monotonic()))

    monkeypatch.setattr(async_llm.input_processor, "process", timed_process)

    async def run():
        ticks = []

        async def tick():
            while True:
                await asyncio.sleep(0.001)
                ticks.append(asyncio.get_running_loop().time())

        ticker = asyncio.create_task(tick())
        with pytest.raises(InvalidRequestError, match="tokens, but max_model_len"):
            await async_llm.add_request("long", prompt, GREEDY)
        ticker.cancel()
        return ticks

    ticks = asyncio.run(run())
    ((started, ended),) = tokenizing
    assert ended - started > 0.01  # long enough for the 1 ms ticker to fire during it
    assert sum(started < t < ended for t in ticks) >= 1


# ----- the engine core in a process of its own (what `chunkserve serve` runs) --------------------



def engine_process(others: list[multiprocessing.Process]) -> multiprocessing.Process:
    (process,) = [p for p in multiprocessing.active_children() if p not in others]
    return process


@pytest.fixture(scope="module")
def process_llm(tiny_gguf):
    llm = AsyncLLM.from_engine_args(EngineArgs(dtype="float32", **tiny_engine_args(tiny_gguf)))
    yield llm
    llm.shutdown()
    assert not llm.is_running and not multiprocessing.active_children()


def test_engine_process_streams_the_offline_text_and_frees_every_block(process_llm, tiny_llm):
    prompts = ["Hello there", "The capital of France is", "1, 2, 3,"]
    expected = [o.outputs[0] for o in tiny_llm.generate(prompts, GREEDY)]
    seen = []
    idle = threading.Event()  # the observers run on the receiver thread, after the streams are fed

    def observe(record, outputs, stats):
        seen.append((record, stats))
        if stats.num_running == stats.num_waiting == 0:
            idle.set()

    process_llm.observers.append(observe)

    async def run(prompt: str, index: int):
        stream = await process_llm.add_request(f"p{index}", prompt, GREEDY)
        return [output async for output in stream]

    async def run_all():
        return await asyncio.gather(*(run(p, i) for i, p in enumerate(prompts)))

    results = asyncio.run(run_all())
    assert idle.wait(10)
    process_llm.observers.clear()
    for outputs, want in zip(results, expected):
        assert [o.finished for o in outputs] == [False] * 7 + [True]
        assert "".join(o.outputs[0].text_delta for o in outputs) == want.text
        assert outputs[-1].outputs[0].token_ids == want.token_ids
    steps = [record for record, _ in seen if record is not None]
    kept = {record.step_id: record for record in process_llm.step_records}
    assert steps and all(kept[record.step_id] == record for record in steps)
    final = seen[-1][1]
    assert final.num_running == final.num_waiting == 0 and final.num_free_blocks == final.num_blocks


def test_engine_process_refusals_keep_their_type_and_field(process_llm):
    async def run():
        with pytest.raises(InvalidRequestError, match="prompt is empty") as refused:
            await process_llm.add_request("empty", "", GREEDY)
        assert refused.value.param == "prompt"
        stream = await process_llm.add_request("twice", "Hi", GREEDY)
        with pytest.raises(InvalidRequestError, match="already in use"):
            await process_llm.add_request("twice", "Hi", GREEDY)
        return [output async for output in stream][-1]

    assert asyncio.run(run()).finished


def test_engine_process_that_cannot_start_raises_why(tiny_gguf):
    before = multiprocessing.active_children()
    with pytest.raises(InvalidRequestError, match="max_model_len 1000000 exceeds the model's limit"):
        AsyncLLM.from_engine_args(EngineArgs(dtype="float32", **tiny_engine_args(tiny_gguf, max_model_len=10**6)))
    assert multiprocessing.active_children() == before


def test_a_killed_engine_process_fails_its_streams_and_refuses_new_requests(tiny_gguf, monkeypatch):
    monkeypatch.setenv(TEST_STEP_DELAY_ENV, str(STEP_DELAY_MS))  # the 400 tokens outlast the kill by construction
    others = multiprocessing.active_children()
    llm = AsyncLLM.from_engine_args(EngineArgs(dtype="float32", **tiny_engine_args(tiny_gguf)))

    async def run():
        stream = await llm.add_request("doomed", "Tell me a story", SamplingParams(max_tokens=400))
        with pytest.raises(EngineDeadError, match="exited unexpectedly"):
            async for output in stream:
                if len(output.outputs[0].token_ids) == 1:
                    engine_process(others).kill()  # as the OOM killer would
        with pytest.raises(EngineDeadError):
            await llm.add_request("late", "Hi", GREEDY)

    asyncio.run(run())
    assert not llm.is_running
    llm.shutdown()


# ----- the frontend against a scripted core (the engine process runs ahead of the frontend) -------

class ScriptedCore:
    """Stands in for the engine core: records the commands; the test plays its events."""

    def __init__(self, on_event, vocab_size: int) -> None:
        self.on_event = on_event
        self.info = EngineInfo("model", 2048, vocab_size)
        self.sent = []

    def send(self, command) -> None:
        self.sent.append(command)

    def is_alive(self) -> bool:
        return True

    def close(self, timeout_s: float) -> None:
        pass

    async def added(self, count: int) -> str:
        """The core id of the `count`-th request added, once the frontend has sent it (it is
        tokenized on a thread first)."""
        while len(adds := [c for c in self.sent if isinstance(c, AddRequest)]) < count:
            await asyncio.sleep(0.001)
        return adds[count - 1].request.request_id


def scripted_llm(tokenizer) -> tuple[AsyncLLM, ScriptedCore]:
    cores = []
    llm = AsyncLLM(lambda on_event: cores.append(ScriptedCore(on_event, len(tokenizer))) or cores[0],
                   lambda: tokenizer, resolve_model(None), EngineArgs(dtype="float32"))
    return llm, cores[0]


def step_event(*outputs: EngineCoreOutput) -> EngineCoreOutputs:
    return EngineCoreOutputs(list(outputs), 1.0, None, SchedulerStats(0, 0, 0, 1, 1, 0, 0, 0))


@pytest.mark.parametrize("late_output_finishes", [True, False])
def test_a_reused_id_never_gets_the_late_output_of_the_request_a_stop_string_ended(default_tokenizer,
                                                                                  late_output_finishes):
    """The core runs the step after the one that completed a stop string before it sees the
    abort; that step's output may arrive after the caller has re-added the same id."""
    llm, core = scripted_llm(default_tokenizer)
    stopping, late, fresh = (default_tokenizer.encode(text) for text in (" one STOP", " LATE", " fresh"))

    async def run():
        adding = asyncio.create_task(llm.add_request("a", "Hi", SamplingParams(max_tokens=50, stop=["STOP"])))
        first_id = await core.added(1)
        core.on_event(Accepted(first_id, None))
        first = await adding
        core.on_event(step_event(EngineCoreOutput(first_id, stopping, None)))
        assert [o async for o in first][-1].outputs[0].finish_reason == "stop"
        assert AbortRequests([first_id]) in core.sent
        adding = asyncio.create_task(llm.add_request("a", "Hi", SamplingParams(max_tokens=50)))
        second_id = await core.added(2)
        core.on_event(step_event(EngineCoreOutput(first_id, late, None, "length" if late_output_finishes else None)))
        core.on_event(Accepted(second_id, None))
        second = await adding
        core.on_event(step_event(EngineCoreOutput(second_id, fresh, None, "length")))
        return [o async for o in second]

    (only,) = asyncio.run(asyncio.wait_for(run(), 10))
    assert only.request_id == "a" and only.outputs[0].token_ids == fresh


def test_an_output_that_cannot_be_processed_fails_its_request_alone(default_tokenizer, monkeypatch):
    llm, core = scripted_llm(default_tokenizer)
    real_add_tokens = IncrementalDetokenizer.add_tokens

    def add_tokens(self, token_ids):
        if token_ids == [13]:
            raise ValueError("injected tokenizer fault")
        return real_add_tokens(self, token_ids)

    monkeypatch.setattr(IncrementalDetokenizer, "add_tokens", add_tokens)

    async def run():
        streams = {}
        for count, name in enumerate(("victim", "survivor"), 1):
            adding = asyncio.create_task(llm.add_request(name, "Hi", SamplingParams(max_tokens=5)))
            core_id = await core.added(count)
            core.on_event(Accepted(core_id, None))
            streams[name] = (core_id, await adding)
        core.on_event(step_event(EngineCoreOutput(streams["victim"][0], [13], None),
                                 EngineCoreOutput(streams["survivor"][0], [14], None, "length")))
        with pytest.raises(RuntimeError, match="injected tokenizer fault"):
            async for _ in streams["victim"][1]:
                pass
        return [o async for o in streams["survivor"][1]], streams["victim"][0]

    survivor, victim_id = asyncio.run(asyncio.wait_for(run(), 10))
    assert survivor[-1].finished and survivor[-1].outputs[0].token_ids == [14]
    assert AbortRequests([victim_id]) in core.sent and llm.is_running

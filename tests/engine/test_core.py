"""The engine core on a simulated executor (no model): what it sends per step."""

from __future__ import annotations

import pickle

import pytest

from chunkserve.config import EngineArgs, resolve_model
from chunkserve.engine.core import EngineCore
from chunkserve.engine.messages import EngineCoreRequest
from chunkserve.executor.simulated import SimulatedExecutor
from chunkserve.model.loader import load_model_config
from chunkserve.sampling_params import SamplingParams

NUM_REQUESTS = 32


@pytest.fixture(scope="module")
def model_config():
    return load_model_config(resolve_model(None))


def decode_messages(model_config, history: int, num_steps: int) -> list[bytes]:
    """The pickled per-step messages of `num_steps` pure decode steps of 32 requests whose
    prompts hold `history` tokens."""
    blocks = NUM_REQUESTS * (history + num_steps + 80) // 16 + 64
    core = EngineCore(EngineArgs(dtype="float32",
                                 max_num_batched_tokens=8192, max_num_seqs=NUM_REQUESTS, num_kv_blocks=blocks),
                      SimulatedExecutor(model_config, blocks))
    params = SamplingParams(max_tokens=num_steps + 64, ignore_eos=True, temperature=0)  # none ends early
    for i in range(NUM_REQUESTS):
        prompt = [1000 + (i * 31 + j) % 5000 for j in range(history)]
        core.add_request(EngineCoreRequest(f"request-{i}", prompt, params, None, arrival_time=0.0))
    while core.step().record.num_prefill_tokens or core.get_stats().num_waiting:
        pass  # until every prompt is computed
    messages = []
    for _ in range(num_steps):
        step = core.step()
        assert step.record.num_decode_tokens == NUM_REQUESTS and len(step.outputs) == NUM_REQUESTS
        messages.append(pickle.dumps(step.outputs))
    return messages


def test_a_steps_message_does_not_grow_with_history(model_config):
    short = decode_messages(model_config, 256, 40)
    long = decode_messages(model_config, 4096, 40)
    sizes = {len(m) for m in short + long}
    assert len(sizes) == 1, f"message sizes vary with history: {sorted(sizes)}"
    assert sizes.pop() < 100 * NUM_REQUESTS  # a request's new token and counters, not its history


def test_the_simulated_core_finishes_every_request_and_frees_every_block(model_config):
    blocks = 64
    core = EngineCore(EngineArgs(dtype="float32",
                                 max_num_batched_tokens=64, max_num_seqs=8, num_kv_blocks=blocks, max_model_len=256),
                      SimulatedExecutor(model_config, blocks))
    for i in range(12):
        core.add_request(EngineCoreRequest(f"r{i}", [1000 + i] * (20 + 9 * i), SamplingParams(max_tokens=30),
                                           None, arrival_time=0.0))
    produced: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        step = core.step()
        for output in step.outputs:
            produced.setdefault(output.request_id, []).extend(output.new_token_ids)
            assert output.finish_reason in (None, "length")
    assert {len(tokens) for tokens in produced.values()} == {30} and len(produced) == 12
    stats = core.get_stats()
    assert stats.num_free_blocks == stats.num_blocks


class LoadingExecutor(SimulatedExecutor):
    """The simulated executor with a connector's worker side that finishes every load and
    send in the step that asks for it (steps with nothing scheduled included)."""

    def execute_model(self, scheduler_output):
        result = super().execute_model(scheduler_output)
        meta = scheduler_output.kv_connector_metadata
        result.finished_recving, result.finished_sending = set(meta["load"]), set(meta["send"])
        return result


def test_kv_progress_reported_by_a_step_with_nothing_scheduled_is_not_lost(model_config):
    from tests.core.support import FakeRemoteConnector

    core = EngineCore(EngineArgs(dtype="float32",
                                 max_num_batched_tokens=64, max_num_seqs=4, num_kv_blocks=64, max_model_len=256,
                                 block_size=4), LoadingExecutor(model_config, 64), kv_connector=FakeRemoteConnector())
    core.add_request(EngineCoreRequest("remote-a", list(range(1000, 1030)), SamplingParams(max_tokens=3), None, 0.0))
    tokens = []
    for _ in range(20):
        if not core.has_unfinished_requests():
            break
        step = core.step()  # the first has nothing to run: the request waits for its KV
        tokens += [t for o in (step.outputs if step else []) for t in o.new_token_ids]
    assert not core.has_unfinished_requests() and len(tokens) == 3
    stats = core.get_stats()
    assert stats.num_free_blocks == stats.num_blocks  # sent, then freed


def test_a_search_for_a_failing_request_ends_even_when_the_pool_is_short(model_config):
    """The request that makes steps fail needs blocks the waiting ones hold: it preempts one of
    them (not itself), fails alone, and everyone else finishes (the search once stayed on with
every step empty)."""
    blocks = 8
    core = EngineCore(EngineArgs(dtype="float32",
                                 max_num_batched_tokens=96, max_num_seqs=8, num_kv_blocks=blocks, max_model_len=128),
                      SimulatedExecutor(model_config, blocks))
    execute = core.executor.execute_model

    def fragile(scheduler_output):  # breaks whenever "bad" is in the step, and does not say so
        if any(s.request_id == "bad" for s in scheduler_output.scheduled):
            raise RuntimeError("a kernel failed")
        return execute(scheduler_output)

    core.executor.execute_model = fragile
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0)
    for i in range(3):
        core.add_request(EngineCoreRequest(f"d{i}", [1000 + 50 * i + j for j in range(14)], params, None, float(i)))
    core.step()
    core.step()
    core.add_request(EngineCoreRequest("bad", [3000 + j for j in range(100)], params, None, arrival_time=10.0))
    finished = {}
    for _ in range(200):
        if not core.has_unfinished_requests():
            break
        step = core.step()
        for output in [] if step is None else step.outputs:
            if output.finished:
                finished[output.request_id] = output.error is not None
    assert finished == {"bad": True, "d0": False, "d1": False, "d2": False}
    assert core.scheduler._only is None and core.check()["ok"]


def test_the_self_check_reports_a_per_request_entry_left_behind(model_config):
    """Once nothing is unfinished, every per-request registry must be empty: one that is not
    (planted here) is a leak the self-check names; while requests run, theirs are no problem."""
    core = EngineCore(EngineArgs(dtype="float32", max_num_batched_tokens=64, max_num_seqs=4, num_kv_blocks=64,
                                 max_model_len=256), SimulatedExecutor(model_config, 64))
    for i in range(3):
        core.add_request(EngineCoreRequest(f"r{i}", [1000 + i] * 30, SamplingParams(max_tokens=5), None, 0.0))
    core.step()
    assert core.check()["problems"] == []
    while core.has_unfinished_requests():
        core.step()
    assert core.check()["ok"]  # (the finished ids the worker hears of with the next step are no leak)
    core.scheduler.chunking.track("ghost", 0.0)  # a request's starvation clock that nobody forgot
    report = core.check()
    assert not report["ok"]
    assert report["problems"] == ["chunking.last_progress: 1 left with no request unfinished"]

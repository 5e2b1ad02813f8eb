"""Request snapshots: a request exported at any step and imported into another engine finishes
exactly as it would have without moving (tokens, text, seeded draws, stop strings), carries
its KV bytes unchanged, and a snapshot that does not fit is refused with nothing allocated."""

from __future__ import annotations

import dataclasses
import random
import re

import pytest

from chunkserve.config.engine import EngineArgs
from chunkserve.core.kv.snapshot import RequestSnapshot
from chunkserve.engine.llm_engine import LLMEngine
from chunkserve.errors import InvalidRequestError
from chunkserve.sampling_params import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)

GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=64, temperature=0.8, top_p=0.9, seed=1234, ignore_eos=True)


def engine(model: str, budget: int = 64, **extra) -> LLMEngine:
    return LLMEngine(EngineArgs(dtype="float32", model=model, max_num_batched_tokens=budget, num_kv_blocks=96, **extra))


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 20000) for _ in range(length)]


def run_to_end(llm: LLMEngine, request_id: str):
    final = None
    while llm.has_unfinished_requests():
        for output in llm.step():
            if output.request_id == request_id and output.finished:
                final = output
    return final


def assert_idle(llm: LLMEngine) -> None:
    report = llm.engine_core.check()
    assert report["ok"], report


def through_the_wire(snapshot: RequestSnapshot) -> RequestSnapshot:
    return RequestSnapshot.from_bytes(snapshot.to_bytes())


EVERY, EDGES = "every", "edges"
BLOCK = 16  # the engine's default block size


def exports_at_every_step(model: str, prompt: list[int], params: SamplingParams, budget: int, steps: str = EVERY):
    """The uninterrupted output, and the outputs of imports of snapshots taken after k steps: at
    every k, or (EDGES) for k < 9, the last 4 output tokens, and each step where the request's
    computed tokens sit next to a block boundary. Each import runs to the end, so exporting at
    every step costs O(steps^2): the default tier runs EDGES for most cases."""
    source, destination = engine(model, budget), engine(model, budget)
    source.add_request("r", prompt, params)
    reference = run_to_end(source, "r")
    source.add_request("r", prompt, params)
    assert source.reset_prefix_cache() is False  # busy
    resumed, k = {}, 0
    while source.has_unfinished_requests():
        request = source.engine_core.scheduler.requests["r"]
        near_a_block_edge = request.num_computed_tokens % BLOCK in (BLOCK - 1, 0)
        near_the_end = params.max_tokens - request.num_output_tokens <= 4
        if steps == EVERY or k < 9 or near_the_end or near_a_block_edge:
            snapshot = through_the_wire(source.export_request("r", "copy"))
            assert destination.reset_prefix_cache()  # as fresh as a new engine
            destination.import_request(snapshot)
            resumed[k] = run_to_end(destination, "r")
            assert_idle(destination)
        source.step()
        k += 1
    assert_idle(source)
    if steps == EDGES:
        assert len(resumed) < k  # else the case belongs to the every-step tier
    return reference, resumed


def over_steps(*cases, every_in_default=()):
    """pytest params: each case with EDGES exports in the default tier and EVERY under `-m slow`;
    the cases in `every_in_default` run EVERY in the default tier (and only that)."""
    params = []
    for case in cases:
        if case in every_in_default:
            params.append(pytest.param(*case, EVERY, id=f"{'-'.join(map(str, case))}-{EVERY}"))
            continue
        params.append(pytest.param(*case, EDGES, id=f"{'-'.join(map(str, case))}-{EDGES}"))
        params.append(pytest.param(*case, EVERY, id=f"{'-'.join(map(str, case))}-{EVERY}", marks=pytest.mark.slow))
    return params


GREEDY_CASES = [(length, budget) for budget in (64, 256) for length in (1, 16, 17, 300)]


@pytest.mark.parametrize("length, budget, steps", over_steps(*GREEDY_CASES, every_in_default=[(300, 64)]))
def test_export_at_every_step_greedy(tiny_model_dir, length, budget, steps):
    """(300, 64) exports at every step in the default tier: mid-prefill chunks, the first decode
    and each decode step."""
    reference, resumed = exports_at_every_step(tiny_model_dir, prompt_of(length), GREEDY, budget, steps)
    assert max(resumed) + 1 >= 64  # the last step is always exported
    for k, output in resumed.items():
        assert output.outputs[0].token_ids == reference.outputs[0].token_ids, f"export after step {k}"
        assert output.outputs[0].text == reference.outputs[0].text, f"export after step {k}"


# 300 tokens (chunks across steps) in every tier; 17 in the long tier
@pytest.mark.parametrize("length, steps", [pytest.param(*p.values, marks=pytest.mark.slow, id=p.id) if p.values[0] == 17
                                           else p for p in over_steps((17,), (300,))])
def test_export_at_every_step_seeded(tiny_model_dir, length, steps):
    reference, resumed = exports_at_every_step(tiny_model_dir, prompt_of(length, 1), SEEDED, 64, steps)
    for k, output in resumed.items():
        assert output.outputs[0].token_ids == reference.outputs[0].token_ids, f"export after step {k}"


def test_stop_string_spanning_the_export_point_resumes_the_stream(tiny_model_dir):
    """A request paused at every step and continued elsewhere: its stream's deltas (before the
    pause here, after it there) concatenate to the uninterrupted text, a stop string spanning
    the pause is still found, and nothing held back is lost or repeated."""
    prompt = prompt_of(17, 2)
    llm = engine(tiny_model_dir)
    llm.add_request("probe", prompt, GREEDY)
    text = run_to_end(llm, "probe").outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 6]
    params = dataclasses.replace(GREEDY, stop=[stop])
    llm.add_request("reference", prompt, params)
    reference = run_to_end(llm, "reference").outputs[0]
    assert reference.finish_reason == "stop" and reference.stop_reason == stop
    destination = engine(tiny_model_dir)
    for k in range(len(reference.token_ids) + 1):
        llm.add_request("r", prompt, params)
        streamed = ""
        for _ in range(k):
            streamed += "".join(o.outputs[0].text_delta for o in llm.step() if o.request_id == "r")
        if not llm.has_unfinished_requests():
            break
        snapshot = through_the_wire(llm.export_request("r", "pause"))
        assert not llm.has_unfinished_requests()
        assert_idle(llm)
        destination.import_request(snapshot)
        final = None
        while destination.has_unfinished_requests():
            for output in destination.step():
                streamed += output.outputs[0].text_delta
                final = output if output.finished else final
        assert streamed == reference.text, f"paused after step {k}"
        assert (final.outputs[0].text, final.outputs[0].finish_reason) == (reference.text, "stop")
        assert_idle(destination)


def test_export_leaves_a_request_mid_prefill_unchanged(tiny_model_dir):
    long_prompt, short_prompt = prompt_of(300, 3), prompt_of(20, 4)
    alone = engine(tiny_model_dir)
    alone.add_request("long", long_prompt, GREEDY)
    expected = run_to_end(alone, "long").outputs[0].token_ids
    llm, destination = engine(tiny_model_dir), engine(tiny_model_dir)
    llm.add_request("short", short_prompt, GREEDY)
    llm.step()
    llm.step()  # the short one decodes
    llm.add_request("long", long_prompt, GREEDY)
    llm.step()  # the long one's first chunk beside the short one's decode
    assert 0 < llm.engine_core.scheduler.requests["long"].num_computed_tokens < len(long_prompt)
    destination.import_request(through_the_wire(llm.export_request("short", "copy")))
    llm.export_request("short", "pause")
    assert run_to_end(llm, "long").outputs[0].token_ids == expected
    run_to_end(destination, "short")
    assert_idle(llm)
    assert_idle(destination)


def test_imported_kv_bytes_equal_the_exporters(tiny_model_dir):
    llm, destination = engine(tiny_model_dir), engine(tiny_model_dir)
    llm.add_request("r", prompt_of(40, 5), GREEDY)
    for _ in range(5):
        llm.step()
    exported = llm.export_request("r", "copy")
    assert exported.num_computed_tokens == 44  # the prompt and 4 of its 5 outputs (the last has no KV yet)
    destination.import_request(through_the_wire(exported))
    again = destination.export_request("r", "copy")
    assert [b.payload for b in again.blocks] == [b.payload for b in exported.blocks]
    assert [b.block_hash for b in again.blocks] == [b.block_hash for b in exported.blocks]
    assert again.blocks[-1].block_hash is None  # two full blocks and a partial one
    for llm_ in (llm, destination):
        llm_.abort_request("r")
        assert_idle(llm_)


def test_blocks_the_destination_caches_travel_without_payload(tiny_model_dir):
    prompt = prompt_of(70, 6)
    llm, destination = engine(tiny_model_dir), engine(tiny_model_dir)
    llm.add_request("reference", prompt, GREEDY)
    reference = run_to_end(llm, "reference").outputs[0].token_ids
    destination.add_request("warm", prompt, dataclasses.replace(GREEDY, max_tokens=1))
    run_to_end(destination, "warm")  # caches the prompt's 4 full blocks
    llm.add_request("r", prompt, GREEDY)
    for _ in range(4):
        llm.step()
    full = llm.engine_core.export_request("r", "copy")
    cached = {b.block_hash for b in full.blocks if b.block_hash is not None
              and destination.engine_core.scheduler.kv.pool.lookup(b.block_hash) is not None}
    assert len(cached) == 4
    delta = through_the_wire(llm.export_request("r", "pause", skip_block_hashes=frozenset(cached)))
    assert [b.payload is None for b in delta.blocks] == [b.block_hash in cached for b in delta.blocks]
    assert len(delta.to_bytes()) < len(full.to_bytes()) // 2
    destination.import_request(delta)
    assert run_to_end(destination, "r").outputs[0].token_ids == reference
    assert_idle(destination)


def tampered(snapshot: RequestSnapshot, what: str) -> RequestSnapshot:
    copy = dataclasses.replace(snapshot, blocks=list(snapshot.blocks))
    if what == "fingerprint":
        copy.fingerprint = dataclasses.replace(copy.fingerprint, weights_hash="0" * 64)
    elif what == "block size":
        copy.fingerprint = dataclasses.replace(
            copy.fingerprint, layout=dataclasses.replace(copy.fingerprint.layout, block_size=32))
    elif what == "crc":
        payload = bytearray(copy.blocks[1].payload)
        payload[100] ^= 0x40
        copy.blocks[1] = dataclasses.replace(copy.blocks[1], payload=bytes(payload))
    elif what == "missing block":
        copy.blocks[0] = dataclasses.replace(copy.blocks[0], payload=None)
    elif what == "tokens":
        copy.prompt_token_ids = [copy.prompt_token_ids[0] + 1, *copy.prompt_token_ids[1:]]
    elif what == "block count":
        copy.blocks = copy.blocks[:-1]
    elif what == "frontend state":
        copy.frontend_state = {**copy.frontend_state, "metrics": {"arrival": 1.0}}
    elif what == "too long":
        copy.sampling_params = dataclasses.replace(copy.sampling_params, max_tokens=10_000)
    return copy


@pytest.mark.parametrize("what, message", [
    ("fingerprint", "another model: weights hash differs"),
    ("block size", "block_size is 32 in the KV but 16 here"),
    ("crc", "block 1 is corrupt"),
    ("missing block", "block 0's KV was left out"),
    ("tokens", "block 0's hash does not match its tokens"),
    ("block count", "KV blocks but its"),
    ("frontend state", "frontend state cannot be restored"),
    ("too long", "may reach 10040 tokens .prompt \\+ max_tokens., more than this engine's max_model_len"),
])
def test_a_tampered_or_mismatched_snapshot_is_refused_with_nothing_allocated(tiny_model_dir, what, message):
    llm, destination = engine(tiny_model_dir), engine(tiny_model_dir)
    llm.add_request("r", prompt_of(40, 7), GREEDY)
    for _ in range(3):
        llm.step()
    snapshot = tampered(llm.export_request("r", "copy"), what)
    free = destination.get_stats().num_free_blocks
    with pytest.raises(InvalidRequestError, match=message):
        destination.import_request(through_the_wire(snapshot))
    assert destination.get_stats().num_free_blocks == free
    assert not destination.has_unfinished_requests()
    assert_idle(destination)
    destination.import_request(llm.export_request("r", "pause"))  # the untouched one is taken
    run_to_end(destination, "r")
    assert_idle(destination)


def test_export_errors_name_the_problem(tiny_model_dir):
    llm = engine(tiny_model_dir)
    with pytest.raises(InvalidRequestError, match="no unfinished request 'nope'"):
        llm.export_request("nope")
    llm.add_request("r", prompt_of(5), GREEDY)
    with pytest.raises(InvalidRequestError, match="export mode must be one of"):
        llm.export_request("r", "move")
    with pytest.raises(InvalidRequestError, match="already in use"):
        llm.import_request(llm.export_request("r", "copy"))
    llm.abort_request("r")
    assert_idle(llm)


def test_a_constrained_request_resumes_inside_its_grammar(tiny_model_dir):
    """Its grammar is rebuilt on import from the output so far: every resumed output is the
    uninterrupted one, and it matches the regex."""
    email = r"[a-z]{3,12}@[a-z]{2,8}\.org"
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=StructuredOutputsParams(regex=email))
    reference, resumed = exports_at_every_step(tiny_model_dir, prompt_of(20), params, 64)
    assert re.fullmatch(email, reference.outputs[0].text) and reference.outputs[0].finish_reason == "stop"
    assert len(resumed) > 3
    assert all(r.outputs[0].token_ids == reference.outputs[0].token_ids for r in resumed.values())

"""The disk KV tier (--enable-hierarchical-cache) in a real engine, on a tiny random-weight
model with a KV pool too small to keep a prompt between requests: prompts come back from disk
(across restarts too) with the greedy output of a run that computed them, damaged or vanished
files are misses that are recomputed, the folder stays under its limit, and
reset_prefix_cache empties it."""

from __future__ import annotations

import os
import threading
import time

import pytest

from chunkserve.config import EngineArgs
from chunkserve.core.kv.disk_store import HEADER, BlockFiles
from chunkserve.core.kv.kv_cache_manager import ROOT_HASH, hash_block
from chunkserve.core.request import RequestStatus
from chunkserve.engine.llm_engine import LLMEngine
from chunkserve.sampling_params import SamplingParams
from tests.core.support import forge

BLOCK = 16
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [1000 + (i * 37) % 5000 for i in range(100)]  # 6 full blocks before the last token
FILLER = [7000 + (i * 53) % 5000 for i in range(100)]
pytestmark = pytest.mark.parametrize("tiny_model_dir", ["llama"], indirect=True)


def make_engine(model_dir: str, tier_dir=None, policy: str = "write_through", **overrides) -> LLMEngine:
    """Eight blocks: one 100-token request fits, the next one evicts it."""
    args = dict(model=model_dir, num_kv_blocks=8, block_size=BLOCK, max_num_batched_tokens=64)
    if tier_dir is not None:
        args.update(enable_hierarchical_cache=True, hicache_storage_dir=str(tier_dir), hicache_write_policy=policy)
    args.update(overrides)
    return LLMEngine(EngineArgs(dtype="float32", **args))


def wait_until_io_thread_idle(worker_side, timeout_s: float = 30.0) -> None:
    """Wait until the I/O thread has queued a completion for every job submitted to it, so the
    next step takes them all (a fixed sleep could let a read finish a step later)."""
    deadline = time.monotonic() + timeout_s
    while worker_side._in_flight != worker_side._done.qsize():
        assert time.monotonic() < deadline, "the disk tier's I/O thread did not finish its jobs"
        time.sleep(0.005)


def generate(engine: LLMEngine, prompt: list[int], request_id: str = "r") -> tuple[list[int], int]:
    """Greedy tokens and cached prompt tokens of one request; steps on until the engine is
    idle, the tier's writes included."""
    engine.add_request(request_id, prompt, PARAMS)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final = output
    return list(final.outputs[0].token_ids), final.num_cached_tokens


def finish(engine: LLMEngine) -> None:
    report = engine.engine_core.check()
    assert report["ok"], report
    engine.engine_core.shutdown()


def tier_of(engine: LLMEngine):
    return engine.engine_core.scheduler.connector


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The outputs without a tier: PROMPT, FILLER, PROMPT again (recomputed), and PROMPT's
    continuation with a follow-up."""
    engine = make_engine(tiny_model_dir)
    first, _ = generate(engine, PROMPT)
    filler, _ = generate(engine, FILLER)
    again, cached = generate(engine, PROMPT)
    assert first == again and cached < 96, "the pool kept the prompt: it is not small enough"
    follow_up = PROMPT + first + [4321, 1234, 2345]
    continued, _ = generate(engine, follow_up)
    finish(engine)
    return {"prompt": first, "filler": filler, "follow_up": follow_up, "continued": continued}


def test_a_stored_block_is_byte_identical_to_the_pool(tiny_model_dir, tmp_path):
    engine = make_engine(tiny_model_dir, tmp_path, num_kv_blocks=64)
    generate(engine, PROMPT)
    core = engine.engine_core
    tier, pool = tier_of(engine), core.scheduler.kv.pool
    stored = tier.stored_hashes()
    assert len(stored) == (len(PROMPT) + PARAMS.max_tokens - 1) // BLOCK
    block_ids = [pool.lookup(block_hash) for block_hash in stored]
    in_pool = core.executor.collective_rpc("read_kv_blocks", (block_ids,))[0]
    for block_hash, payload in zip(stored, in_pool):
        result = tier.files.read(block_hash)
        assert result.ok and bytes(result.payload) == payload
    finish(engine)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_prompt_the_pool_evicted_comes_back_from_disk(tiny_model_dir, tmp_path, reference, policy):
    engine = make_engine(tiny_model_dir, tmp_path, policy)
    assert generate(engine, PROMPT) == (reference["prompt"], 0)
    assert generate(engine, FILLER)[0] == reference["filler"]
    tokens, cached = generate(engine, PROMPT)
    assert tokens == reference["prompt"]
    assert cached == 96  # every full block but the one of the last token, the pool's hit and the tier's
    stats = engine.get_stats()
    assert stats.kv_tier.hit_tokens_total > 0 and stats.kv_tier.load_bytes_total > 0
    assert stats.kv_tier.corrupt_blocks_total == 0
    # the pool's hits and the tier's are counted apart
    assert stats.prefix_cache_hits_total + stats.kv_tier.hit_tokens_total == 96
    finish(engine)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_restarted_engine_continues_a_conversation_from_disk(tiny_model_dir, tmp_path, reference, policy):
    first = make_engine(tiny_model_dir, tmp_path, policy, num_kv_blocks=64)
    assert generate(first, PROMPT)[0] == reference["prompt"]
    finish(first)  # write_back saves the pool's blocks now
    second = make_engine(tiny_model_dir, tmp_path, policy, num_kv_blocks=64)
    tokens, cached = generate(second, reference["follow_up"])
    assert tokens == reference["continued"]
    history = len(PROMPT) + PARAMS.max_tokens
    assert cached == history // BLOCK * BLOCK  # the whole history but its last, partial block
    assert second.get_stats().prefix_cache_hits_total == 0
    finish(second)


def prompt_hashes(count: int) -> list[bytes]:
    hashes, parent = [], ROOT_HASH
    for i in range(count):
        parent = hash_block(parent, PROMPT[i * BLOCK: (i + 1) * BLOCK])
        hashes.append(parent)
    return hashes


@pytest.fixture
def stored_prompt(tiny_model_dir, tmp_path):
    """A tier folder holding PROMPT's blocks, and their hashes in order."""
    engine = make_engine(tiny_model_dir, tmp_path, num_kv_blocks=64)
    generate(engine, PROMPT)
    files = tier_of(engine).files
    hashes = prompt_hashes(6)
    assert all(tier_of(engine).is_stored(h) for h in hashes)
    finish(engine)
    return files, hashes


@pytest.mark.parametrize("kind", ["truncated", "flipped_payload_byte", "wrong_fingerprint", "wrong_block_size",
                                  "bad_magic"])
def test_a_damaged_block_file_is_a_miss_recomputed_and_removed(tiny_model_dir, tmp_path, reference, stored_prompt,
                                                               kind):
    files, hashes = stored_prompt
    forge(files, hashes[3], kind)
    engine = make_engine(tiny_model_dir, tmp_path, "write_back")  # (write_back: nothing is stored again yet)
    tokens, cached = generate(engine, PROMPT)
    assert tokens == reference["prompt"]
    assert cached == 3 * BLOCK  # up to the damaged block
    assert engine.get_stats().kv_tier.corrupt_blocks_total == 1
    assert not os.path.exists(files.path(hashes[3])) and not tier_of(engine).is_stored(hashes[3])
    assert all(tier_of(engine).is_stored(h) for h in hashes[4:])  # the blocks after it are fine
    finish(engine)


def test_a_recomputed_block_is_stored_again(tiny_model_dir, tmp_path, reference, stored_prompt):
    files, hashes = stored_prompt
    forge(files, hashes[3], "flipped_payload_byte")
    engine = make_engine(tiny_model_dir, tmp_path)  # write_through
    assert generate(engine, PROMPT) == (reference["prompt"], 3 * BLOCK)
    assert tier_of(engine).is_stored(hashes[3])
    assert os.path.getsize(files.path(hashes[3])) == HEADER.size + files.payload_bytes
    assert files.read(hashes[3]).ok
    finish(engine)


def test_a_load_racing_the_files_eviction_is_recomputed(tiny_model_dir, tmp_path, reference, stored_prompt):
    files, hashes = stored_prompt
    engine = make_engine(tiny_model_dir, tmp_path)
    executor = engine.engine_core.executor
    execute = executor.execute_model
    raced = []

    def delete_then_execute(scheduler_output):  # after the lookup planned the load, before the read
        meta = scheduler_output.kv_connector_metadata
        if meta.loads and not raced:
            raced.append(files.path(hashes[1]))
            os.remove(files.path(hashes[1]))
        return execute(scheduler_output)

    executor.execute_model = delete_then_execute
    tokens, cached = generate(engine, PROMPT)
    assert raced and tokens == reference["prompt"]
    assert cached == BLOCK
    assert engine.get_stats().kv_tier.corrupt_blocks_total == 0
    finish(engine)


def folder_bytes(files: BlockFiles) -> int:
    """What the folder holds now; a temporary file renamed while it is listed counts under its new name."""
    total = 0
    for root, _, names in os.walk(files.folder):
        for name in names:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except FileNotFoundError:  # renamed into place (or removed) by the I/O thread meanwhile
                pass
    return total


def test_the_folder_stays_under_its_limit_least_recently_used_first(tiny_model_dir, tmp_path, reference):
    probe = make_engine(tiny_model_dir, tmp_path)
    file_bytes = tier_of(probe).files.file_bytes
    finish(probe)
    engine = make_engine(tiny_model_dir, tmp_path, hicache_storage_max_gb=4.5 * file_bytes / (1 << 30))
    tier = tier_of(engine)
    executor = engine.engine_core.executor
    execute = executor.execute_model
    sizes = []

    def measure(scheduler_output):
        sizes.append(folder_bytes(tier.files))
        output = execute(scheduler_output)
        sizes.append(folder_bytes(tier.files))
        return output

    executor.execute_model = measure
    generate(engine, PROMPT)
    prompt_blocks = tier.stored_hashes()
    assert generate(engine, FILLER)[0] == reference["filler"]
    assert max(sizes) <= 4.5 * file_bytes and len(tier.stored_hashes()) == 4
    assert not set(tier.stored_hashes()) & set(prompt_blocks)  # the older prompt's went first
    assert engine.get_stats().kv_tier.stored_bytes == 4 * file_bytes
    finish(engine)


def test_reset_prefix_cache_clears_the_tier(tiny_model_dir, tmp_path, reference):
    engine = make_engine(tiny_model_dir, tmp_path)
    generate(engine, PROMPT)
    files = tier_of(engine).files
    assert files.scan()
    assert engine.reset_prefix_cache()
    assert files.scan() == [] and tier_of(engine).stored_hashes() == []
    tokens, cached = generate(engine, PROMPT)
    assert tokens == reference["prompt"] and cached == 0
    finish(engine)


def test_a_request_aborted_while_its_kv_loads_never_gets_it_written(tiny_model_dir, tmp_path, reference,
                                                                     stored_prompt):
    """Its blocks go to the next request at once; its reads, done only after that request has
    computed KV into them, land nowhere."""
    engine = make_engine(tiny_model_dir, tmp_path)
    worker_side = engine.engine_core.executor.worker.kv_connector
    read, release = worker_side.files.read, threading.Event()
    reads_returned = []

    def held_read(block_hash):
        release.wait(10)
        result = read(block_hash)
        reads_returned.append(block_hash)
        return result

    worker_side.files.read = held_read
    engine.add_request("loading", PROMPT, PARAMS)
    engine.step()
    request = engine.engine_core.scheduler.requests["loading"]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    engine.abort_request("loading")
    engine.add_request("filler", FILLER, PARAMS)
    engine.step()  # the filler's first chunk, in the blocks the aborted request held
    release.set()
    wait_until_io_thread_idle(worker_side)
    assert len(reads_returned) == 6  # every stored block of the aborted request was read
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    assert list(final.outputs[0].token_ids) == reference["filler"]
    assert not worker_side._loads
    finish(engine)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_many_requests_at_once_sharing_prefixes_get_the_outputs_of_an_engine_without_tier(tiny_model_dir, tmp_path,
                                                                                          policy):
    """Loads, saves, evictions and preemptions interleaved: a small pool, waves of requests
    whose prompts share heads (and come back), some aborted halfway."""
    heads = [[2000 + 97 * h + (i * 31) % 900 for i in range(60 + 40 * h)] for h in range(3)]
    waves = [[heads[(w + i) % 3] + [500 + 11 * w + i] * (3 + i) for i in range(4)] for w in range(4)]

    def run(engine: LLMEngine) -> dict[str, list[int]]:
        tokens = {}
        for w, prompts in enumerate(waves):
            for i, prompt in enumerate(prompts):
                engine.add_request(f"w{w}-{i}", prompt, PARAMS)
            steps = 0
            while engine.has_unfinished_requests():
                steps += 1
                for output in engine.step():
                    if output.finished:
                        tokens[output.request_id] = list(output.outputs[0].token_ids)
                if steps == 3 and w == 2:
                    engine.abort_request([f"w{w}-1"])
        return tokens

    args = dict(num_kv_blocks=16, max_num_seqs=4)
    expected = run(make_engine(tiny_model_dir, **args))
    engine = make_engine(tiny_model_dir, tmp_path, policy, **args)
    assert run(engine) == expected
    stats = engine.get_stats()
    assert stats.kv_tier.hit_tokens_total > 0 and stats.num_preemptions_total > 0
    finish(engine)

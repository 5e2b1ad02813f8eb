"""The disk KV tier without a model: its file format (core/kv/disk_store.py), and its scheduler
side (core/kv/disk_tier.py) driven by the scheduler tests' fake runner, whose "KV" (each slot's
position and token history) is what a block's payload carries here. The fake runner checks the
whole history's KV before every sample, so a block loaded from the tier that is not exactly
the KV its position needs fails the run."""

from __future__ import annotations

import os
import pickle
import random
import zlib

import pytest

from chunkserve.config import EngineArgs
from chunkserve.core.kv.disk_store import HEADER, TMP_SUFFIX, BlockFiles
from chunkserve.core.kv.disk_tier import (
    DiskTierMetadata,
    DiskTierOutput,
    DiskTierScheduler,
    LoadReport,
)
from chunkserve.core.kv.layout import KVLayout, ModelFingerprint
from chunkserve.core.messages import ModelRunnerOutput, SchedulerOutput
from chunkserve.core.request import RequestStatus
from chunkserve.errors import InvalidRequestError
from tests.core.support import (
    BLOCK,
    FakeRunner,
    assert_pool_free,
    forge,
    make_request,
    make_scheduler,
    run,
    some_hash,
)

LAYOUT = KVLayout("float32", num_layers=1, num_kv_heads=1, head_dim=128, block_size=BLOCK)  # 4 KiB payloads
FINGERPRINT = ModelFingerprint("w" * 64, "t" * 64, LAYOUT)


def block_files(tmp_path, fingerprint: ModelFingerprint = FINGERPRINT) -> BlockFiles:
    return BlockFiles(str(tmp_path / "hicache"), fingerprint)


def some_payload(seed: int) -> bytes:
    return random.Random(seed).randbytes(LAYOUT.block_bytes)


# ----- the file format ---------------------------------------------------------------------------


def test_a_block_round_trips_byte_identical(tmp_path):
    files = block_files(tmp_path)
    payload = some_payload(1)
    files.write(some_hash(1), payload)
    path = files.path(some_hash(1))
    assert path == os.path.join(str(tmp_path / "hicache"), FINGERPRINT.digest().hex()[:16], some_hash(1).hex()[:2],
                                some_hash(1).hex() + ".kv")
    assert os.path.getsize(path) == HEADER.size + LAYOUT.block_bytes == files.file_bytes
    result = files.read(some_hash(1))
    assert result.ok and bytes(result.payload) == payload
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]  # no temporary file left


CORRUPTIONS = ["truncated", "flipped_payload_byte", "wrong_fingerprint", "wrong_block_size", "bad_magic",
               "another_blocks_file", "longer"]


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_a_damaged_file_is_a_miss_and_is_removed(tmp_path, kind):
    files = block_files(tmp_path)
    files.write(some_hash(1), some_payload(1))
    forge(files, some_hash(1), kind)
    result = files.read(some_hash(1))
    assert not result.ok and result.corrupt, result
    assert not os.path.exists(files.path(some_hash(1)))


def test_a_block_being_written_is_never_loadable(tmp_path):
    """Until it is renamed into place a block is a temporary file: no read finds it, and the
    index a restart builds skips it (and removes it: its writer is gone)."""
    files = block_files(tmp_path)
    files.write(some_hash(1), some_payload(1))
    final = files.path(some_hash(2))
    tmp = final + ".123.0" + TMP_SUFFIX
    os.makedirs(os.path.dirname(tmp), exist_ok=True)
    with open(tmp, "wb") as f:  # a writer half-way through
        f.write(files.header(some_hash(2), zlib.crc32(some_payload(2))) + some_payload(2)[:1000])
    assert files.read(some_hash(2)).problem == "missing"
    assert [h for h, _, _ in files.scan()] == [some_hash(1)]
    assert not os.path.exists(tmp)


def test_the_index_a_restart_builds_is_least_recently_used_first(tmp_path):
    files = block_files(tmp_path)
    for i in range(4):
        files.write(some_hash(i), some_payload(i))
        os.utime(files.path(some_hash(i)), (1000 + i, 1000 + i))
    os.utime(files.path(some_hash(0)), (2000, 2000))  # loaded last
    tier = DiskTierScheduler(files, 10 * files.file_bytes)
    assert tier.stored_hashes() == [some_hash(1), some_hash(2), some_hash(3), some_hash(0)]
    smaller = DiskTierScheduler(files, 2 * files.file_bytes)  # the limit was lowered: the oldest go
    assert smaller.stored_hashes() == [some_hash(3), some_hash(0)]
    assert sorted(h for h, _, _ in files.scan()) == sorted([some_hash(3), some_hash(0)])


def test_engine_args_check_the_tier_flags():
    EngineArgs(enable_hierarchical_cache=True, hicache_write_policy="write_back")
    for bad in (dict(hicache_write_policy="write_around"), dict(hicache_storage_backend="redis"),
                dict(hicache_storage_max_gb=0), dict(hicache_storage_dir=""),
                dict(enable_hierarchical_cache=True, enable_prefix_caching=False)):
        with pytest.raises(InvalidRequestError):
            EngineArgs(**bad)


# ----- the scheduler's side, with a fake worker side -----------------------------------------------


class TierRunner(FakeRunner):
    """The fake runner with the tier's worker side done synchronously: saves are copied out of
    the slots before the step computes anything and written at once; loads are read and copied
    in at the start of the step after the one that asked for them (so requests wait a step)."""

    def __init__(self, files: BlockFiles) -> None:
        super().__init__(BLOCK)
        self.files = files
        self.loads: dict[str, list[tuple[int, bytes]]] = {}
        self.metas: list[DiskTierMetadata] = []
        self.before_loads = None  # called with the loads about to be read

    def payload(self, block_id: int) -> bytes:
        slots = [self.slots.get(block_id * BLOCK + i) for i in range(BLOCK)]
        raw = zlib.compress(pickle.dumps(slots))
        assert len(raw) + 4 <= LAYOUT.block_bytes
        return (len(raw).to_bytes(4, "little") + raw).ljust(LAYOUT.block_bytes, b"\0")

    def put(self, block_id: int, payload: bytes) -> None:
        size = int.from_bytes(payload[:4], "little")
        for i, value in enumerate(pickle.loads(zlib.decompress(payload[4: 4 + size]))):
            if value is None:
                self.slots.pop(block_id * BLOCK + i, None)
            else:
                self.slots[block_id * BLOCK + i] = value

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        meta: DiskTierMetadata = output.kv_connector_metadata
        self.metas.append(meta)
        report, finished, invalid = DiskTierOutput(), set(), set()
        for request_id in meta.cancelled:
            self.loads.pop(request_id, None)
        for block_id, block_hash in meta.saves:
            self.files.write(block_hash, self.payload(block_id))
            report.stored.append((block_hash, self.files.file_bytes, 0.001))
        if self.before_loads and self.loads:
            self.before_loads(self.loads)
        for request_id, blocks in self.loads.items():
            results = [self.files.read(block_hash) for _, block_hash in blocks]
            for (block_id, block_hash), result in zip(blocks, results):
                if result.ok:
                    self.put(block_id, bytes(result.payload))
                else:
                    invalid.add(block_id)
                    report.bad_blocks.append((block_hash, result.corrupt))
            valid = next((i for i, r in enumerate(results) if not r.ok), len(results))
            report.loads.append(LoadReport(request_id, len(blocks), valid, valid * self.files.file_bytes, 0.001))
            finished.add(request_id)
        self.loads = dict(meta.loads)
        result = super().execute(output)
        result.finished_recving, result.invalid_block_ids = finished, invalid
        result.kv_connector_output = report
        return result


def tier_scheduler(tmp_path, num_blocks: int, policy: str = "write_through", max_files: int = 1000):
    files = block_files(tmp_path)
    tier = DiskTierScheduler(files, max_files * files.file_bytes, policy)
    return make_scheduler(num_blocks=num_blocks, kv_connector=tier), tier, TierRunner(files)


def same_prompt(request, request_id: str, max_tokens: int = 6):
    again = make_request(request_id, request.num_prompt_tokens, max_tokens)
    again.prompt_token_ids = list(request.prompt_token_ids)
    return again


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_a_prompt_the_pool_evicted_is_loaded_from_the_tier(tmp_path, policy):
    scheduler, tier, runner = tier_scheduler(tmp_path, num_blocks=12, policy=policy)
    first, filler = make_request("a", 37, 6), make_request("filler", 40, 6)
    again = same_prompt(first, "a-again")
    plain = run(make_scheduler(num_blocks=12), [same_prompt(r, r.request_id) for r in (first, filler, again)])
    outputs = {}
    for request in (first, filler, again):
        outputs.update(run(scheduler, [request], runner=runner))
    assert outputs == plain
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == 36  # every full block but the last token's
    stats = tier.get_kv_connector_stats()
    assert stats.hit_tokens_total == 36 and stats.corrupt_blocks_total == 0
    assert stats.stored_files == len(tier.stored_hashes()) > 0
    assert any(meta.loads for meta in runner.metas)


def test_a_block_is_loadable_only_once_its_write_is_confirmed(tmp_path):
    scheduler, tier, _ = tier_scheduler(tmp_path, num_blocks=100)
    first = make_request("a", 21, 1)
    scheduler.add_request(first)
    output = scheduler.schedule()
    scheduler.update_from_output(output, FakeRunner().execute(output))  # computes all 21: 5 blocks registered
    assert first.is_finished and tier.has_pending_work() and scheduler.has_unfinished_requests()
    output = scheduler.schedule()  # hands the saves to the worker
    assert len(output.kv_connector_metadata.saves) == 5 and tier.has_pending_work()
    again = same_prompt(first, "b")
    assert tier.get_num_new_matched_tokens(again, 0) == (0, False)  # written, not confirmed
    report = DiskTierOutput(stored=[(h, 1, 0.0) for _, h in output.kv_connector_metadata.saves])
    scheduler.update_from_output(output, ModelRunnerOutput({}, kv_connector_output=report))
    assert not tier.has_pending_work() and not scheduler.has_unfinished_requests()
    assert tier.get_num_new_matched_tokens(again, 0) == (20, True)


def test_a_request_finished_while_loading_cancels_its_load(tmp_path):
    scheduler, tier, runner = tier_scheduler(tmp_path, num_blocks=40)
    first = make_request("a", 30, 2)
    run(scheduler, [first], runner=runner)
    scheduler.kv.reset_prefix_cache()  # the pool forgets, the tier keeps
    again = same_prompt(first, "b")
    scheduler.add_request(again)
    output = scheduler.schedule()
    assert again.status == RequestStatus.WAITING_FOR_REMOTE_KVS and output.kv_connector_metadata.loads
    scheduler.update_from_output(output, runner.execute(output))  # the load is in flight
    scheduler.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert_pool_free(scheduler)  # freed at once: the worker copies loads only between steps
    assert tier.has_pending_work()  # the cancel is still to be sent
    output = scheduler.schedule()
    assert output.kv_connector_metadata.cancelled == {"b"}
    scheduler.update_from_output(output, runner.execute(output))
    assert not runner.loads and not scheduler.has_unfinished_requests()


def test_a_load_that_finds_its_file_gone_recomputes_from_that_block(tmp_path):
    scheduler, tier, runner = tier_scheduler(tmp_path, num_blocks=40)
    first = make_request("a", 30, 4)
    run(scheduler, [first], runner=runner)
    scheduler.kv.reset_prefix_cache()
    again = same_prompt(first, "b", 4)
    hashes = scheduler.kv.block_hashes_for(again, 7)

    def evict_third(loads):  # between the lookup and the read, as an LRU eviction would
        tier.files.remove(hashes[2])

    runner.before_loads = evict_third
    assert run(scheduler, [again], runner=runner)["b"] == first.output_token_ids
    assert again.num_cached_tokens == 2 * BLOCK
    stats = tier.get_kv_connector_stats()
    assert stats.hit_tokens_total == 2 * BLOCK and stats.corrupt_blocks_total == 0
    assert tier.is_stored(hashes[2])  # computed again, stored again


def test_a_corrupt_file_is_counted_and_recomputed(tmp_path):
    scheduler, tier, runner = tier_scheduler(tmp_path, num_blocks=40)
    first = make_request("a", 30, 4)
    run(scheduler, [first], runner=runner)
    scheduler.kv.reset_prefix_cache()
    again = same_prompt(first, "b", 4)
    hashes = scheduler.kv.block_hashes_for(again, 7)
    forge(tier.files, hashes[4], "flipped_payload_byte")
    assert run(scheduler, [again], runner=runner)["b"] == first.output_token_ids
    assert again.num_cached_tokens == 4 * BLOCK
    assert tier.get_kv_connector_stats().corrupt_blocks_total == 1


def folder_bytes(files: BlockFiles) -> int:
    total = 0
    for root, _, names in os.walk(files.folder):
        total += sum(os.path.getsize(os.path.join(root, n)) for n in names)
    return total


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_the_tier_never_exceeds_its_size_and_keeps_the_most_recent(tmp_path, policy):
    scheduler, tier, runner = tier_scheduler(tmp_path, num_blocks=10, policy=policy, max_files=5)
    limit = tier.max_bytes

    def check(scheduler, output):
        assert folder_bytes(tier.files) <= limit
        assert tier.get_kv_connector_stats().stored_bytes <= limit

    requests = [make_request(f"r{i}", 17, 2) for i in range(8)]
    for request in requests:
        run(scheduler, [request], check=check, runner=runner)
    assert folder_bytes(tier.files) <= limit and len(tier.stored_hashes()) == 5
    if policy == "write_through":  # the last request's four full blocks, and one of the one before
        last = scheduler.kv.block_hashes_for(same_prompt(requests[-1], "x"), 4)
        assert tier.stored_hashes()[1:] == last[::-1]  # stored at once: a prefix's head is evicted last


def test_write_back_saves_on_eviction_and_everything_at_shutdown(tmp_path):
    scheduler, tier, runner = tier_scheduler(tmp_path, num_blocks=12, policy="write_back")
    first = make_request("a", 37, 2)
    run(scheduler, [first], runner=runner)
    assert tier.stored_hashes() == []  # nothing evicted yet
    tier.begin_shutdown()
    assert scheduler.has_unfinished_requests()
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        scheduler.update_from_output(output, runner.execute(output))
    assert tier.stored_hashes() == scheduler.kv.block_hashes_for(same_prompt(first, "x"), 9)[::-1]


def test_reset_prefix_cache_clears_the_tier(tmp_path):
    scheduler, tier, runner = tier_scheduler(tmp_path, num_blocks=40)
    run(scheduler, [make_request("a", 30, 2)], runner=runner)
    assert tier.stored_hashes() and tier.files.scan()
    assert scheduler.reset_prefix_cache()
    assert tier.stored_hashes() == [] and tier.files.scan() == []
    assert tier.get_kv_connector_stats().stored_bytes == 0


def test_writes_in_flight_when_the_tier_is_reset_are_removed_as_they_land(tmp_path):
    scheduler, tier, _ = tier_scheduler(tmp_path, num_blocks=40)
    first = make_request("a", 21, 1)
    scheduler.add_request(first)
    output = scheduler.schedule()
    scheduler.update_from_output(output, FakeRunner().execute(output))
    output = scheduler.schedule()
    saves = output.kv_connector_metadata.saves
    assert saves and scheduler.reset_prefix_cache()
    for _, block_hash in saves:  # the worker writes them after the reset
        tier.files.write(block_hash, some_payload(0))
    report = DiskTierOutput(stored=[(h, tier.files.file_bytes, 0.0) for _, h in saves])
    scheduler.update_from_output(output, ModelRunnerOutput({}, kv_connector_output=report))
    assert tier.stored_hashes() == [] and tier.files.scan() == [] and not tier.has_pending_work()


def test_the_tiers_counters_reach_metrics():
    from chunkserve.core.stats import KVTierStats, SchedulerStats
    from chunkserve.entrypoints.server.metrics import EngineMetrics

    metrics = EngineMetrics("m")
    base = dict(num_running=0, num_waiting=0, num_preempted_waiting=0, num_free_blocks=8, num_blocks=8,
                num_preemptions_total=0, prefix_cache_queries_total=100, prefix_cache_hits_total=32)
    metrics.observe(None, [], SchedulerStats(**base))  # no tier: the counters stay at 0
    tier = KVTierStats(hit_tokens_total=64, load_bytes_total=4096, load_seconds_total=0.25, store_bytes_total=8192,
                       store_seconds_total=0.5, corrupt_blocks_total=1, stored_files=2, stored_bytes=8192)
    metrics.observe(None, [], SchedulerStats(**base, kv_tier=tier))
    text = metrics.render().decode()
    for line in ('chunkserve:hicache_hit_tokens_total{engine="0",model_name="m"} 64.0',
                 'chunkserve:hicache_load_bytes_total{engine="0",model_name="m"} 4096.0',
                 'chunkserve:hicache_load_seconds_total{engine="0",model_name="m"} 0.25',
                 'chunkserve:hicache_store_bytes_total{engine="0",model_name="m"} 8192.0',
                 'chunkserve:hicache_store_seconds_total{engine="0",model_name="m"} 0.5',
                 'chunkserve:hicache_corrupt_blocks_total{engine="0",model_name="m"} 1.0',
                 'chunkserve:hicache_stored_bytes{engine="0",model_name="m"} 8192.0',
                 'chunkserve:prefix_cache_hits_total{engine="0",model_name="m"} 32.0'):
        assert line in text, line

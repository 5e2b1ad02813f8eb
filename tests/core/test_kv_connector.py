"""The KV-connector seam, driven by a fake connector that "loads" a prompt's leading blocks
from elsewhere (writing their KV into the fake runner's slots, as a real transfer would) and
holds finished requests' blocks until it has "sent" them."""

from __future__ import annotations

from chunkserve.core.kv_connector import NoOpConnector
from chunkserve.core.messages import ModelRunnerOutput
from chunkserve.core.request import Request, RequestStatus
from tests.core.support import (
    BLOCK,
    ConnectedRunner,
    FakeRemoteConnector,
    FakeRunner,
    assert_pool_free,
    make_request,
    make_scheduler,
    run,
)


def test_remote_kv_is_awaited_then_only_the_rest_is_computed():
    connector = FakeRemoteConnector()
    scheduler = make_scheduler(kv_connector=connector)
    requests = [make_request("remote-a", 37, 6), make_request("local", 20, 6), make_request("remote-b", 9, 4)]
    plain = run(make_scheduler(), [make_request(r.request_id, r.num_prompt_tokens, r.max_tokens) for r in requests])
    runner = ConnectedRunner({r.request_id: list(r.prompt_token_ids) for r in requests})
    statuses = []
    held_after_finish = False
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        held_after_finish |= all(r.is_finished for r in requests) and scheduler.kv.num_free_blocks < scheduler.kv.num_blocks
        output = scheduler.schedule()
        statuses.append({r.request_id: r.status for r in requests})
        scheduled = {s.request_id: s for s in output.scheduled}
        for request_id in ("remote-a", "remote-b"):
            if statuses[-1][request_id] == RequestStatus.WAITING_FOR_REMOTE_KVS:
                assert request_id not in scheduled, "a request ran before its KV arrived"
        if "remote-a" in scheduled and not scheduled["remote-a"].is_decode:
            assert scheduled["remote-a"].num_computed_tokens >= 36 - BLOCK  # only its tail is computed here
        scheduler.update_from_output(output, runner.execute(output))
    assert any(s["remote-a"] == RequestStatus.WAITING_FOR_REMOTE_KVS for s in statuses)
    assert {r.request_id: r.output_token_ids for r in requests} == plain
    assert connector.external == {"remote-a": 36, "remote-b": 8}
    assert requests[0].num_cached_tokens == 36
    assert held_after_finish, "blocks are held until the connector has sent them"
    assert_pool_free(scheduler)  # and the engine kept stepping until it had


def test_a_reused_id_does_not_take_the_blocks_of_a_finished_request_still_sending():
    connector = FakeRemoteConnector()
    scheduler = make_scheduler(kv_connector=connector)
    runner = FakeRunner()
    old = make_request("r", 10, 1)
    scheduler.add_request(old)
    while not old.is_finished:
        output = scheduler.schedule()
        scheduler.update_from_output(output, runner.execute(output))
    held = [b for b in range(scheduler.kv.num_blocks) if scheduler.kv.pool.ref_count(b)]
    assert held and scheduler.kv.block_table("r") == []
    new = make_request("r", 10, 1)
    new.prompt_token_ids = [900 + i for i in range(10)]
    scheduler.add_request(new)
    scheduler.schedule()  # builds the connector's metadata: the old r's blocks are sent now
    assert not set(scheduler.kv.block_table("r")) & set(held), "the new r took the old r's blocks"
    output = scheduler.schedule()
    scheduler.update_from_output(output, ModelRunnerOutput({}, finished_sending={"r"}))
    assert all(scheduler.kv.pool.ref_count(b) == 0 for b in held)  # the old r's, sent
    assert scheduler.kv.block_table("r"), "the new r keeps its own"


def test_an_aborted_request_waiting_for_remote_kv_frees_its_blocks():
    connector = FakeRemoteConnector()
    connector.request_finished = NoOpConnector().request_finished  # nothing to send
    scheduler = make_scheduler(kv_connector=connector)
    request = make_request("remote-x", 30, 4)
    scheduler.add_request(request)
    scheduler.schedule()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and scheduler.kv.block_table("remote-x")
    scheduler.finish_requests(["remote-x"], RequestStatus.FINISHED_ABORTED)
    assert_pool_free(scheduler)


def test_requests_loading_remote_kv_hold_a_sequence_slot():
    connector = FakeRemoteConnector()
    connector.request_finished = NoOpConnector().request_finished
    scheduler = make_scheduler(kv_connector=connector, max_num_seqs=1)
    requests = [make_request(f"remote-{i}", 30, 20) for i in range(3)]
    runner = ConnectedRunner({r.request_id: list(r.prompt_token_ids) for r in requests})
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        loading = sum(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in requests)
        assert len(scheduler.running) + loading <= 1
        scheduler.update_from_output(output, runner.execute(output))
    assert_pool_free(scheduler)


class TierLikeConnector(FakeRemoteConnector):
    """Like a disk tier: a preempted request finds its computed blocks elsewhere and loads them."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if not request.num_preemptions:
            return 0, False
        return max((request.num_tokens - 1) // BLOCK * BLOCK - num_computed_tokens, 0), True

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        self.to_load[request.request_id] = (list(block_ids), request)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        return False, None


def test_a_preempted_request_loading_its_kv_back_is_not_readmitted_to_thrash():
    """The no-thrash rule holds for requests whose KV a connector loads back too: six requests each
    growing to 30 blocks of a 64-block pool are each preempted at most once (11 times in all when
    a load let a preempted request straight back in), with the outputs of an ample pool."""
    specs = [(f"big{i}", 4 * 10, 4 * 20 - 1) for i in range(6)]
    ample = run(make_scheduler(num_blocks=1000, max_num_batched_tokens=64), [make_request(*s) for s in specs])
    connector = TierLikeConnector()
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=64, max_model_len=4 * 64, kv_connector=connector)
    requests = [make_request(*s) for s in specs]
    runner = FakeRunner()
    for request in requests:
        scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        result = runner.execute(output)
        for request_id, (block_ids, request) in output.kv_connector_metadata["load"].items():
            runner.tables[request_id] = block_ids  # the KV its own computation wrote
            tokens = request.all_token_ids
            for pos in range((request.num_tokens - 1) // BLOCK * BLOCK):
                runner.slots[runner.slot(request_id, pos)] = (pos, tuple(tokens[: pos + 1]))
            result.finished_recving.add(request_id)
        scheduler.update_from_output(output, result)
    assert {r.request_id: r.output_token_ids for r in requests} == ample
    assert scheduler.num_preemptions <= len(specs)
    assert_pool_free(scheduler)

"""Prefill/decode disaggregation, the scheduler's sides (core/disagg/prefill.py, decode.py)
driven through a real `Scheduler` with a fake clock: no sockets, no torch. The connector's
worker side is faked at its boundary exactly as the real one reports (PrefillOutput /
DecodeOutput in `kv_connector_output`, `finished_sending` / `finished_recving`), and the fake
runner of test_scheduler.py checks that every block the prefill side lists holds the KV its
step computed, and that a decode request continues from the right KV and token."""

from __future__ import annotations

import dataclasses

import pytest

from chunkserve.core.disagg.decode import DecodeConnectorScheduler
from chunkserve.core.disagg.prefill import PrefillConnectorScheduler
from chunkserve.core.disagg.protocol import (
    BlockSend,
    Bootstrap,
    DecodeOutput,
    FirstToken,
    PrefillOutput,
    Receive,
    TransferParams,
    prompt_digest,
)
from chunkserve.core.messages import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from chunkserve.core.request import Request, RequestStatus
from chunkserve.sampling_params import SamplingParams
from tests.core.support import (
    BLOCK,
    EOS,
    FakeRunner,
    assert_pool_free,
    fake_model,
    make_request,
    make_scheduler,
)

PEER = b"decode-0"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def disagg_request(request_id: str, prompt_len: int, room: int, max_tokens: int = 1,
                   prompt: list[int] | None = None) -> Request:
    request = make_request(request_id, prompt_len, max_tokens)
    if prompt is not None:
        request.prompt_token_ids = list(prompt)
    request.kv_transfer_params = TransferParams(room, "127.0.0.1", 9)
    return request


def num_blocks_of(request: Request) -> int:
    return -(-request.num_prompt_tokens // BLOCK)


def bootstrap_for(request: Request, first_block: int = 0, credits: int = 1000, peer: bytes = PEER,
                  digest: str | None = None, num_blocks: int | None = None) -> Bootstrap:
    return Bootstrap(request.kv_transfer_params.room, peer, first_block,
                     num_blocks_of(request) if num_blocks is None else num_blocks, credits,
                     prompt_digest(request.prompt_token_ids) if digest is None else digest)


def only_output(outputs, request_id: str):
    mine = [o for o in outputs if o.request_id == request_id]
    assert len(mine) == 1, outputs
    return mine[0]


# ----- prefill -----------------------------------------------------------------------------------------


class PrefillHarness:
    """A prefill instance's scheduler; the connector's worker side is faked as the real one
    behaves at its boundary: it pushes the listed blocks after the step's forward (this checks
    they hold exactly the KV the step computed), reports a request finished sending once its
    final blocks are listed, and finished sending for the requests the scheduler released.
    What the decode side sends (`inbox`) arrives with the next step's output."""

    def __init__(self, num_blocks: int = 256, bootstrap_timeout: float = 10.0, lease_timeout: float = 5.0,
                 **config) -> None:
        self.clock = FakeClock()
        self.connector = PrefillConnectorScheduler(BLOCK, bootstrap_timeout, lease_timeout, clock=self.clock)
        self.scheduler = make_scheduler(num_blocks, kv_connector=self.connector, **config)
        self.runner = FakeRunner()
        self.inbox = PrefillOutput()
        self.prompts: dict[str, list[int]] = {}
        self.sends: list[tuple[int, BlockSend]] = []  # (step number, send)
        self.fails: list[tuple[bytes, int, str]] = []  # every fail the worker was asked to send
        self.num_steps = 0

    def add(self, request: Request) -> None:
        self.prompts[request.request_id] = list(request.prompt_token_ids)
        self.scheduler.add_request(request)

    def step(self):
        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        result = self.runner.execute(output)
        for send in meta.sends:
            self._check_computed(send)
            self.sends.append((self.num_steps, send))
            if send.final:
                result.finished_sending.add(send.request_id)
                self.inbox.sent.append((send.request_id, 0, 0.01))
        result.finished_sending |= meta.released
        self.fails += meta.fails
        result.kv_connector_output, self.inbox = (self.inbox or None), PrefillOutput()
        outputs = self.scheduler.update_from_output(output, result)
        self.num_steps += 1
        return output, meta, outputs

    def _check_computed(self, send: BlockSend) -> None:
        prompt = self.prompts[send.request_id]
        for index, block_id in send.blocks:
            for pos in range(index * BLOCK, min((index + 1) * BLOCK, len(prompt))):
                assert self.runner.slots.get(block_id * BLOCK + pos % BLOCK) == (pos, tuple(prompt[: pos + 1])), (
                    f"{send.request_id}: block {index} (id {block_id}) is listed but position {pos}'s KV is not "
                    "computed in it")

    def listed(self, request_id: str) -> list[int]:
        return [index for _, send in self.sends if send.request_id == request_id for index, _ in send.blocks]


def test_prefill_lists_each_block_as_its_step_computes_it_from_the_decode_sides_first_block():
    """A chunked prompt's KV streams to the decode instance while the prompt is still computing
    (lower TTFT), never a block before its KV is computed, never the blocks the decode instance
    caches already; the partial last block goes only in the step that completes the prompt,
    with the final message."""
    h = PrefillHarness(max_num_batched_tokens=8)
    request = disagg_request("p", 30, room=11)  # 8 blocks, the last one 2 tokens
    h.add(request)
    _, meta, _ = h.step()  # tokens 0-7; nobody asked for the room yet
    assert meta.sends == []
    h.inbox.bootstraps.append(bootstrap_for(request, first_block=2))
    steps = []
    while h.scheduler.has_unfinished_requests():
        output, meta, _ = h.step()
        steps.append((output, meta))
    assert [(n, [i for i, _ in s.blocks], s.final) for n, s in h.sends] == [
        (2, [2, 3, 4, 5], False),  # blocks 2-3 (step 1) and 4-5 (step 2); the bootstrap came after step 1's listing
        (3, [6, 7], True),  # the step that completes the prompt: the rest, the partial block included, final
    ]
    final_step = steps[-1][0]
    assert [s.sample for s in final_step.scheduled] == [True]
    send = h.sends[-1][1]
    assert send.room == 11 and send.peer == PEER and send.prompt_len == 30 and send.num_cached_tokens == 0
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert_pool_free(h.scheduler)  # everything was out in the step that listed it: no delayed free
    assert h.scheduler.stats().kv_transfer.transfers_total == 1


def test_prefill_lists_within_credits_and_holds_a_finished_requests_blocks_until_sent():
    """Credits bound what travels (at most `credits` blocks in flight, so a long prompt's KV
    cannot pile up in socket buffers); credits that arrive after the request finished release
    the rest from blocks held for it (delay_free), freed once the last of them is out. Its
    bootstrap arrived before the request (early) and is matched."""
    h = PrefillHarness(num_blocks=64)
    request = disagg_request("p", 26, room=12)  # 7 blocks in one step
    h.connector.update_connector_output(PrefillOutput(bootstraps=[bootstrap_for(request, credits=2)]))
    assert h.connector.get_kv_connector_stats().num_bootstrapping == 1  # early: waits for its request
    h.add(request)
    _, meta, _ = h.step()
    assert [[i for i, _ in s.blocks] for s in meta.sends] == [[0, 1]] and not meta.sends[0].final
    assert request.status == RequestStatus.FINISHED_LENGTH  # its one token is sampled; its KV is not all out
    assert h.scheduler.kv.num_free_blocks == 64 - 7, "a finished request's unsent blocks are held"
    assert h.scheduler.has_unfinished_requests()
    listed, credited = 2, 0
    for _ in range(30):
        if listed > credited:  # the decode side copied in what arrived: as many credits back
            h.inbox.credits.append((12, listed - credited))
            credited = listed
        _, meta, _ = h.step()
        listed += sum(len(s.blocks) for s in meta.sends)
        assert listed - credited <= 2, "more blocks in flight than the decode side granted"
        assert all(len(s.blocks) <= 2 for s in meta.sends)
        if any(s.final for s in meta.sends):
            break
    assert h.listed("p") == list(range(7))
    assert [s.final for _, s in h.sends] == [False, False, False, True]
    assert not h.scheduler.has_unfinished_requests()
    assert_pool_free(h.scheduler)  # freed when finished_sending named it


def _finished_after_a_credit_limited_transfer(h: PrefillHarness, request_id: str, room: int) -> None:
    request = disagg_request(request_id, 26, room=room)
    h.connector.update_connector_output(PrefillOutput(bootstraps=[bootstrap_for(request, credits=4)]))
    h.add(request)
    h.step()
    h.inbox.credits.append((room, 4))
    h.step()
    _, meta, _ = h.step()
    assert [s.final for s in meta.sends] == [True] and not h.scheduler.has_unfinished_requests()


def test_prefill_a_transfer_completed_after_the_request_finished_is_not_failed_later():
    """A transfer that succeeded stays a success: kv_transfer_failed_total (/metrics) does not
    grow when the decode side, done with the room, stops renewing its lease."""
    h = PrefillHarness(num_blocks=64, lease_timeout=5.0)
    _finished_after_a_credit_limited_transfer(h, "p", 13)
    stats = h.scheduler.stats().kv_transfer
    assert stats.failed_total == 0
    h.clock.advance(6.0)
    h.step()
    stats = h.scheduler.stats().kv_transfer
    assert (stats.num_transferring, stats.failed_total, stats.transfers_total) == (0, 0, 1)


def test_prefill_a_new_request_reusing_a_finished_requests_id_gets_its_own_room():
    """Request ids may be reused at once (the scheduler holds a finished request's blocks apart
    from its id): a new request with the id of one whose transfer completed sends its own KV
    to its own decode instance."""
    h = PrefillHarness(num_blocks=64)
    _finished_after_a_credit_limited_transfer(h, "p", 14)
    again = disagg_request("p", 26, room=15)
    again.prompt_token_ids = [500 + i for i in range(26)]
    h.connector.update_connector_output(PrefillOutput(bootstraps=[bootstrap_for(again, peer=b"d2")]))
    h.add(again)
    h.step()
    h.step()
    sends = [s for _, s in h.sends if s.room == 15]
    assert [i for s in sends for i, _ in s.blocks] == list(range(7)) and sends[-1].final


def test_prefill_an_early_bootstrap_whose_request_never_comes_is_told_so():
    """A decode instance that asked for a room no request reaches is answered (after the
    bootstrap timeout) instead of waiting out its own."""
    h = PrefillHarness(bootstrap_timeout=10.0)
    ghost = disagg_request("ghost", 10, room=16)
    h.connector.update_connector_output(PrefillOutput(bootstraps=[bootstrap_for(ghost)]))
    h.clock.advance(9.0)
    _, meta, _ = h.step()
    assert meta.fails == []
    h.clock.advance(1.5)
    _, meta, _ = h.step()
    assert [(peer, room) for peer, room, _ in meta.fails] == [(PEER, 16)]
    assert "within 10 s" in meta.fails[0][2]
    assert h.connector.get_kv_connector_stats().num_bootstrapping == 0


def test_prefill_bootstrap_timeout_fails_a_running_request_and_frees_its_blocks():
    """No decode instance asks for the room in time: the request fails with a retryable KV
    transfer error (HTTP 503) instead of holding its KV forever."""
    h = PrefillHarness(max_num_batched_tokens=8, bootstrap_timeout=10.0)
    request = disagg_request("p", 40, room=17)
    h.add(request)
    h.step()
    h.clock.advance(9.5)
    _, _, outputs = h.step()
    assert outputs == []
    h.clock.advance(1.0)
    _, meta, outputs = h.step()
    out = only_output(outputs, "p")
    assert out.finish_reason == "abort" and out.kv_transfer_failed
    assert "KV transfer failed" in out.error and "within 10 s" in out.error
    assert meta.fails == [(None, 17, "no decode instance bootstrapped room 17 within 10 s")]  # the worker forgets it; nobody to tell
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert not h.scheduler.has_unfinished_requests()
    assert_pool_free(h.scheduler)
    assert h.scheduler.stats().kv_transfer.failed_total == 1


def test_prefill_bootstrap_timeout_frees_the_held_blocks_of_a_finished_request():
    """A finished request whose decode instance never asks holds its KV only until the
    bootstrap timeout."""
    h = PrefillHarness(num_blocks=64, bootstrap_timeout=10.0)
    request = disagg_request("p", 10, room=18)
    h.add(request)
    h.step()
    assert request.is_finished and h.scheduler.kv.num_free_blocks == 64 - 3
    h.clock.advance(10.5)
    _, meta, outputs = h.step()
    assert meta.released == {"p"} and outputs == []
    assert_pool_free(h.scheduler)
    assert not h.scheduler.has_unfinished_requests()


def test_prefill_lease_timeout_fails_the_request_and_tells_the_decode_side():
    """A decode instance that stops renewing its hold (credits, leases) for `lease_timeout`
    releases the request's KV; while it renews, nothing expires."""
    h = PrefillHarness(max_num_batched_tokens=8, lease_timeout=5.0)
    request = disagg_request("p", 60, room=19)
    h.add(request)
    h.inbox.bootstraps.append(bootstrap_for(request))
    h.step()
    for _ in range(3):  # renewed every 4 s: alive
        h.clock.advance(4.0)
        h.inbox.leases.append(19)
        _, meta, outputs = h.step()
        assert outputs == [] and meta.fails == []
    h.clock.advance(4.0)
    h.step()  # the last renewal arrives with this step's output
    h.clock.advance(5.5)
    _, meta, outputs = h.step()
    assert [(peer, room) for peer, room, _ in meta.fails] == [(PEER, 19)]
    out = only_output(outputs, "p")
    assert out.kv_transfer_failed and "lease" in out.error
    assert_pool_free(h.scheduler)


@pytest.mark.parametrize("problem", ["digest", "num_blocks", "first_block"])
def test_prefill_refuses_a_bootstrap_that_does_not_match_the_request(problem):
    """A decode instance that tokenized the prompt differently (another tokenizer or chat
    template) or expects another number of blocks gets a failure, never KV for another prompt."""
    h = PrefillHarness(max_num_batched_tokens=8)
    request = disagg_request("p", 30, room=20)
    h.add(request)
    h.step()
    bad = {"digest": dict(digest="0" * 32), "num_blocks": dict(num_blocks=9),
           "first_block": dict(first_block=8)}[problem]
    h.inbox.bootstraps.append(bootstrap_for(request, **bad))
    _, _, outputs = h.step()
    _, meta, _ = h.step()
    assert [(peer, room) for peer, room, _ in meta.fails] == [(PEER, 20)]
    assert meta.sends == [] and all(s.request_id != "p" for _, s in h.sends)
    expected = "tokenized the prompt differently" if problem == "digest" else "expects"
    assert expected in meta.fails[0][2]
    out = only_output(outputs, "p")
    assert out.kv_transfer_failed and expected in out.error
    assert_pool_free(h.scheduler)


def test_prefill_a_refusal_reaches_the_decode_side_even_when_the_engine_goes_idle():
    """A decode instance whose bootstrap is refused is told at once, even when the refused
    request was the prefill instance's last one: the engine steps while the connector has
    something to say (else the decode request waits out its whole waiting timeout)."""
    h = PrefillHarness(max_num_batched_tokens=8)
    request = disagg_request("p", 30, room=28)
    h.add(request)
    h.step()
    h.inbox.bootstraps.append(bootstrap_for(request, digest="0" * 32))
    while h.scheduler.has_unfinished_requests():  # the engine core steps only while this holds
        assert h.num_steps < 20
        h.step()
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert [(peer, room) for peer, room, _ in h.fails] == [(PEER, 28)]


def test_prefill_a_second_bootstrap_of_a_room_is_refused_without_failing_the_first():
    """Only one decode instance receives a room's KV."""
    h = PrefillHarness(max_num_batched_tokens=8)
    request = disagg_request("p", 30, room=21)
    h.add(request)
    h.inbox.bootstraps.append(bootstrap_for(request))
    h.step()
    h.inbox.bootstraps.append(bootstrap_for(request, peer=b"intruder"))
    _, _, outputs = h.step()
    _, meta, _ = h.step()
    assert [(peer, room) for peer, room, _ in meta.fails] == [(b"intruder", 21)]
    assert outputs == []
    while h.scheduler.has_unfinished_requests():
        h.step()
    assert h.listed("p") == list(range(8)) and {s.peer for _, s in h.sends} == {PEER}


def test_prefill_a_bootstrap_for_an_ended_room_is_answered_with_a_fail():
    """A late (or repeated) bootstrap of a room that ended is told why at once instead of
    waiting out the decode side's own timeout."""
    h = PrefillHarness()
    request = disagg_request("p", 10, room=22)
    h.connector.update_connector_output(PrefillOutput(bootstraps=[bootstrap_for(request)]))
    h.add(request)
    h.step()
    assert not h.scheduler.has_unfinished_requests()  # all sent in one step
    h.inbox.bootstraps.append(bootstrap_for(request, peer=b"late"))
    h.step()
    _, meta, _ = h.step()
    assert [(peer, room) for peer, room, _ in meta.fails] == [(b"late", 22)]
    assert "ended on the prefill instance" in meta.fails[0][2]


def test_prefill_an_abort_from_the_decode_side_fails_the_request():
    """The decode instance gave the request up (its client left, its own timeout): the prefill
    instance stops computing and sending it and frees its KV at once."""
    h = PrefillHarness(max_num_batched_tokens=8)
    request = disagg_request("p", 40, room=23)
    h.add(request)
    h.inbox.bootstraps.append(bootstrap_for(request))
    h.step()
    h.step()
    h.inbox.aborted.append((23, "the client disconnected"))
    _, _, outputs = h.step()
    out = only_output(outputs, "p")
    assert out.kv_transfer_failed and "the client disconnected" in out.error
    assert_pool_free(h.scheduler)
    _, meta, _ = h.step()
    assert [peer for peer, _, _ in meta.fails] == [None], "the decode side that gave up is not told again"


def test_prefill_an_aborted_request_tells_the_decode_side():
    """A prefill request the client aborted ends its room: the decode instance is told."""
    h = PrefillHarness(max_num_batched_tokens=8)
    request = disagg_request("p", 40, room=24)
    h.add(request)
    h.inbox.bootstraps.append(bootstrap_for(request))
    h.step()
    h.scheduler.finish_requests(["p"], RequestStatus.FINISHED_ABORTED)
    assert_pool_free(h.scheduler)
    _, meta, _ = h.step()
    assert [(peer, room) for peer, room, _ in meta.fails] == [(PEER, 24)]


def test_prefill_never_lists_blocks_of_a_preempted_request_until_they_are_recomputed():
    """Preemption drops a prompt's KV: while it waits and while it recomputes, none of its
    blocks past what was already sent is listed before its KV is computed again (the harness
    checks every listed block's KV), and each block travels once."""
    h = PrefillHarness(num_blocks=14, max_num_batched_tokens=16, long_prefill_token_threshold=8,
                       max_num_partial_prefills=2, max_long_partial_prefills=2, enable_prefix_caching=False)
    a, b = disagg_request("a", 40, room=25), disagg_request("b", 40, room=26)
    h.add(a)
    h.add(b)
    h.inbox.bootstraps.extend([bootstrap_for(a, peer=b"da"), bootstrap_for(b, peer=b"db")])
    statuses = []
    while h.scheduler.has_unfinished_requests():
        assert h.num_steps < 100
        output, meta, _ = h.step()
        listed_b = any(s.request_id == "b" for s in meta.sends)
        statuses.append((b.status, listed_b, b.num_computed_tokens))
        if b.status in (RequestStatus.PREEMPTED, RequestStatus.WAITING):
            assert not listed_b
    assert b.num_preemptions >= 1
    assert h.listed("a") == list(range(10)) and h.listed("b") == list(range(10))
    first_preempted = next(i for i, s in enumerate(statuses) if s[0] == RequestStatus.PREEMPTED)
    # after its readmission b recomputes what it had sent before anything of it is listed again
    recomputing = [s for s in statuses[first_preempted:] if s[0] == RequestStatus.RUNNING and not s[1]]
    assert recomputing
    assert_pool_free(h.scheduler)


def test_prefill_blocks_listed_in_a_failed_step_are_listed_again():
    """A step that fails (the engine voids it and runs the requests again) loses no KV: the
    blocks it listed are listed again once they are computed."""
    h = PrefillHarness()
    request = disagg_request("p", 10, room=27)
    h.connector.update_connector_output(PrefillOutput(bootstraps=[bootstrap_for(request)]))
    h.add(request)
    failed = h.scheduler.schedule()
    assert [i for s in failed.kv_connector_metadata.sends for i, _ in s.blocks] == [0, 1, 2]
    h.scheduler.void_step(failed)  # the forward raised: on_step_output never ran, nothing was sent
    while h.scheduler.has_unfinished_requests() and h.num_steps < 10:
        h.step()
    assert h.listed("p") == [0, 1, 2] and h.sends[-1][1].final


# ----- decode ------------------------------------------------------------------------------------------


class DecodeRunner(FakeRunner):
    """The fake runner, for requests that arrive with output tokens (a disaggregated decode's
    first token): their history is the prompt and those tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.new: dict[str, object] = {}

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for new in output.new_requests:
            self.new[new.request_id] = new
        news = [dataclasses.replace(n, prompt_token_ids=n.prompt_token_ids + n.output_token_ids)
                for n in output.new_requests]
        return super().execute(dataclasses.replace(output, new_requests=news))


class DecodeHarness:
    """A decode instance's scheduler; the connector's worker side is faked at its boundary:
    `arrive` copies a request's KV into the blocks its Receive named and reports the final
    message (finished_recving + DecodeOutput.received) with the next step."""

    def __init__(self, num_blocks: int = 256, waiting_timeout: float = 30.0, **config) -> None:
        self.clock = FakeClock()
        self.connector = DecodeConnectorScheduler(BLOCK, waiting_timeout, clock=self.clock)
        self.scheduler = make_scheduler(num_blocks, kv_connector=self.connector, **config)
        self.runner = DecodeRunner()
        self.receives: dict[str, Receive] = {}
        self.all_receives: list[Receive] = []
        self.inbox = DecodeOutput()
        self.recving: set[str] = set()
        self.num_steps = 0

    def step(self):
        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        for receive in meta.receives:
            self.receives[receive.request_id] = receive
            self.all_receives.append(receive)
        result = self.runner.execute(output)
        result.finished_recving, self.recving = self.recving, set()
        result.kv_connector_output, self.inbox = (self.inbox or None), DecodeOutput()
        outputs = self.scheduler.update_from_output(output, result)
        self.num_steps += 1
        return output, meta, outputs

    def arrive(self, request: Request, first: FirstToken) -> None:
        receive = self.receives[request.request_id]
        prompt = request.prompt_token_ids
        for offset, block_id in enumerate(receive.block_ids):
            index = receive.first_block + offset
            for pos in range(index * BLOCK, min((index + 1) * BLOCK, len(prompt))):
                self.runner.slots[block_id * BLOCK + pos % BLOCK] = (pos, tuple(prompt[: pos + 1]))
        self.inbox.received.append((request.request_id, first, 4096, 0.25))
        self.recving.add(request.request_id)

    def run_to_end(self) -> None:
        while self.scheduler.has_unfinished_requests():
            assert self.num_steps < 200
            self.step()


def first_token(token_id: int = 77, num_cached_tokens: int = 12, state: bytes | None = b"\x01generator") -> FirstToken:
    return FirstToken(token_id, TokenLogprobs(token_id, -0.5, [(token_id, -0.5), (5, -1.75)]), state,
                      num_cached_tokens)


def expected_continuation(prompt: list[int], first: int, max_tokens: int) -> list[int]:
    tokens = [first]
    while len(tokens) < max_tokens:
        tokens.append(fake_model(prompt + tokens))
    return tokens


def test_decode_waits_for_the_remote_kv_then_continues_from_the_first_token():
    """The decode instance computes nothing of the prompt: the request waits with all its
    blocks pre-allocated, then streams the prefill instance's first token (with its logprobs
    and prefix-cache hit) and decodes from it, one token a step, with the generator state it
    was sent. Its blocks join the prefix cache."""
    h = DecodeHarness()
    request = disagg_request("d", 22, room=31, max_tokens=4)
    h.scheduler.add_request(request)
    output, meta, outputs = h.step()
    assert output.scheduled == [] and outputs == []
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    table = h.scheduler.kv.block_table("d")
    assert len(table) == 6
    [receive] = meta.receives
    assert (receive.request_id, receive.first_block, receive.block_ids) == ("d", 0, table)
    assert receive.params == request.kv_transfer_params and receive.prompt_digest == prompt_digest(
        request.prompt_token_ids)
    assert h.scheduler.stats().kv_transfer.num_preallocated == 1
    output, _, outputs = h.step()
    assert output.scheduled == [] and outputs == [], "nothing runs before its KV arrived"
    first = first_token()
    h.arrive(request, first)
    output, _, outputs = h.step()
    out = only_output(outputs, "d")
    assert (out.new_token_ids, out.new_logprobs, out.finish_reason) == ([77], [first.logprobs], None)
    assert out.num_cached_tokens == 12 and not out.kv_transfer_failed
    assert request.status == RequestStatus.RUNNING
    assert request.num_computed_tokens == 22 and request.num_cached_tokens == 12
    output, _, outputs = h.step()
    [scheduled] = output.scheduled
    assert (scheduled.num_computed_tokens, scheduled.num_scheduled_tokens, scheduled.is_decode) == (22, 1, True)
    new = h.runner.new["d"]
    assert new.output_token_ids == [77] and new.generator_state == b"\x01generator"
    h.run_to_end()
    assert request.output_token_ids == expected_continuation(request.prompt_token_ids, 77, 4)
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert_pool_free(h.scheduler)
    stats = h.scheduler.stats().kv_transfer
    assert (stats.transfers_total, stats.failed_total, stats.num_preallocated) == (1, 0, 0)
    again = disagg_request("d2", 22, room=32, prompt=request.prompt_token_ids)
    h.scheduler.add_request(again)
    _, meta, _ = h.step()
    assert meta.receives[0].first_block == 5, "the received prompt blocks are reusable prefix cache"


def test_decode_asks_only_for_the_blocks_past_its_prefix_cache_hit():
    """Only the delta travels: blocks this pool caches already are not asked for, and the
    request decodes over its cached blocks and the received ones."""
    h = DecodeHarness()
    shared = [900 + i for i in range(8)]
    warm = make_request("warm", 12, max_tokens=1)
    warm.prompt_token_ids = shared + [1, 2, 3, 4]
    h.scheduler.add_request(warm)
    h.run_to_end()
    request = disagg_request("d", 22, room=33, max_tokens=3, prompt=shared + [5 + i for i in range(14)])
    h.scheduler.add_request(request)
    _, meta, _ = h.step()
    [receive] = meta.receives
    table = h.scheduler.kv.block_table("d")
    assert receive.first_block == 2 and receive.block_ids == table[2:] and len(table) == 6
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and request.num_computed_tokens == 8
    h.arrive(request, first_token(num_cached_tokens=0))
    h.run_to_end()
    assert request.output_token_ids == expected_continuation(request.prompt_token_ids, 77, 3)
    assert_pool_free(h.scheduler)


def test_decode_waits_without_blocks_while_the_pool_is_short_and_is_admitted_when_they_free():
    """A request whose prompt does not fit waits (no blocks taken, nothing asked of the
    prefill instance) and is admitted once blocks come back."""
    h = DecodeHarness(num_blocks=12)
    a = disagg_request("a", 30, room=34, max_tokens=2)
    b = disagg_request("b", 30, room=35, max_tokens=2)
    h.scheduler.add_request(a)
    h.scheduler.add_request(b)
    _, meta, _ = h.step()
    assert [r.request_id for r in meta.receives] == ["a"]
    assert b.status == RequestStatus.WAITING and h.scheduler.kv.block_table("b") == []
    stats = h.scheduler.stats().kv_transfer
    assert (stats.num_bootstrapping, stats.num_preallocated) == (1, 1)
    h.arrive(a, first_token())
    _, meta, _ = h.step()
    assert meta.receives == []
    while "b" not in h.receives:
        assert h.num_steps < 20
        assert not (h.scheduler.kv.block_table("b") and h.scheduler.kv.block_table("a"))
        h.step()
    assert a.is_finished and b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    h.arrive(b, first_token())
    h.run_to_end()
    assert b.output_token_ids == expected_continuation(b.prompt_token_ids, 77, 2)
    assert_pool_free(h.scheduler)


@pytest.mark.parametrize("case", ["eos", "max_tokens_1"])
def test_decode_a_first_token_that_ends_the_request_finishes_it_without_a_step(case):
    """EOS (or max_tokens=1) as the prefill instance's token ends the request at once: no
    decode step, its blocks freed."""
    h = DecodeHarness()
    if case == "eos":
        request = Request("d", [3 + i for i in range(10)], SamplingParams(max_tokens=5), eos_token_id=EOS)
        request.kv_transfer_params = TransferParams(36, "127.0.0.1", 9)
        token, reason = EOS, "stop"
    else:
        request = disagg_request("d", 10, room=36, max_tokens=1)
        token, reason = 42, "length"
    h.scheduler.add_request(request)
    h.step()
    h.arrive(request, first_token(token))
    output, _, outputs = h.step()
    out = only_output(outputs, "d")
    assert (out.new_token_ids, out.finish_reason) == ([token], reason)
    assert not h.scheduler.has_unfinished_requests()
    assert_pool_free(h.scheduler)
    output, _, outputs = h.step()
    assert output.scheduled == [] and outputs == [] and "d" not in h.runner.new


@pytest.mark.parametrize("state", ["seen", "preallocated", "transferring"])
def test_decode_waiting_timeout_aborts_the_request_in_every_state(state):
    """A request never waits for its KV longer than `waiting_timeout`, whether it was never
    admitted (pool short), pre-allocated or receiving: it fails with a retryable error and its
    blocks are freed (the worker is told to drop the room if it was asked for it)."""
    h = DecodeHarness(num_blocks=12, waiting_timeout=30.0)
    blocker = disagg_request("blocker", 30, room=40, max_tokens=500)
    if state == "seen":
        h.scheduler.add_request(blocker)
        h.step()
        h.arrive(blocker, first_token())
        h.step()
        assert blocker.status == RequestStatus.RUNNING
        h.clock.advance(1.0)
    request = disagg_request("d", 30, room=41, max_tokens=4)
    h.scheduler.add_request(request)
    h.step()
    if state == "seen":
        assert request.status == RequestStatus.WAITING and "d" not in h.receives
    else:
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    if state == "transferring":
        h.inbox.progress.append("d")
        h.step()
        assert h.scheduler.stats().kv_transfer.num_transferring == 1
    h.clock.advance(29.0)
    _, _, outputs = h.step()
    assert all(o.request_id != "d" for o in outputs)
    h.clock.advance(1.5)
    free_before = h.scheduler.kv.num_free_blocks
    _, _, outputs = h.step()
    out = only_output(outputs, "d")
    assert out.finish_reason == "abort" and out.kv_transfer_failed
    assert "within 30 s" in out.error and f"it was {'bootstrapping' if state == 'seen' else state}" in out.error
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert h.scheduler.kv.block_table("d") == []
    if state != "seen":
        assert h.scheduler.kv.num_free_blocks == free_before + 8
    _, meta, _ = h.step()
    assert set(meta.cancelled) == {41}  # the prefill side is told, whether it was asked yet or not
    assert h.scheduler.stats().kv_transfer.failed_total == 1
    if state == "seen":
        assert blocker.status == RequestStatus.RUNNING  # received: no deadline any more
        h.scheduler.finish_requests(["blocker"], RequestStatus.FINISHED_ABORTED)
    assert_pool_free(h.scheduler)


def test_decode_an_abort_while_waiting_cancels_the_room_and_frees_blocks_at_once():
    """A client that leaves while its KV is in flight frees the blocks at once; the worker
    drops the room (late blocks are never written) and tells the prefill instance."""
    h = DecodeHarness()
    request = disagg_request("d", 30, room=42, max_tokens=4)
    h.scheduler.add_request(request)
    h.step()
    h.inbox.progress.append("d")
    h.step()
    h.scheduler.finish_requests(["d"], RequestStatus.FINISHED_ABORTED)
    assert_pool_free(h.scheduler)
    _, meta, _ = h.step()
    assert set(meta.cancelled) == {42} and meta.receives == []
    h.inbox.received.append(("d", first_token(), 100, 0.1))  # a late report for it changes nothing
    h.recving.add("d")
    _, _, outputs = h.step()
    assert outputs == [] and not h.scheduler.has_unfinished_requests()


def test_decode_a_failure_the_worker_reports_aborts_the_request_and_caches_nothing():
    """A failed transfer (bad crc, refused bootstrap, prefill instance gone) fails the request
    with a retryable error, frees its blocks, and leaves nothing of its KV in the prefix
    cache (a later identical request asks for all of it again)."""
    h = DecodeHarness()
    request = disagg_request("d", 22, room=44, max_tokens=4)
    h.scheduler.add_request(request)
    h.step()
    h.inbox.progress.append("d")
    h.step()
    h.inbox.failed.append(("d", "block 3 of room 44 arrived corrupted (crc32 mismatch)"))
    _, _, outputs = h.step()
    out = only_output(outputs, "d")
    assert out.finish_reason == "abort" and out.kv_transfer_failed and "crc32 mismatch" in out.error
    assert_pool_free(h.scheduler)
    again = disagg_request("d2", 22, room=45, max_tokens=4, prompt=request.prompt_token_ids)
    h.scheduler.add_request(again)
    _, meta, _ = h.step()
    [receive] = meta.receives
    assert receive.first_block == 0 and again.num_computed_tokens == 0
    assert h.scheduler.prefix_cache_hits == 0


def test_decode_a_preempted_request_recomputes_locally_instead_of_asking_again():
    """Preemption on the decode instance (pool pressure from growing decodes) never turns into
    a failed request: the preempted request recomputes its prompt and tokens here (the prefill
    instance ended the room once the KV was sent) and its output is unchanged."""
    h = DecodeHarness(num_blocks=6)
    a = disagg_request("a", 7, room=46, max_tokens=10)
    b = disagg_request("b", 7, room=47, max_tokens=10)
    for request in (a, b):
        h.scheduler.add_request(request)
    h.step()
    assert set(h.receives) == {"a", "b"}
    h.arrive(a, first_token(70))
    h.arrive(b, first_token(71))
    for _ in range(60):
        if not h.scheduler.has_unfinished_requests():
            break
        h.step()
        for request in (a, b):
            assert not (request.num_preemptions and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS), (
                f"preempted {request.request_id} waits for remote KV again")
    assert a.num_preemptions + b.num_preemptions >= 1
    assert [r.request_id for r in h.all_receives] == ["a", "b"], "asked the prefill instance again"
    assert a.output_token_ids == expected_continuation(a.prompt_token_ids, 70, 10)
    assert b.output_token_ids == expected_continuation(b.prompt_token_ids, 71, 10)
    assert_pool_free(h.scheduler)

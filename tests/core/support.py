"""Helpers shared by the tests of tests/core/ (support, not a test module)."""

from __future__ import annotations

import dataclasses
import random
import zlib

from chunkserve.config import SchedulerConfig
from chunkserve.core.kv.disk_store import HEADER, BlockFiles
from chunkserve.core.kv_connector import KVConnectorScheduler
from chunkserve.core.messages import ModelRunnerOutput, SchedulerOutput
from chunkserve.core.request import Request
from chunkserve.core.sched.scheduler import Scheduler
from chunkserve.sampling_params import SamplingParams

BLOCK = 4


EOS = 0


def make_scheduler(num_blocks: int = 1000, predictor=None, clock=None, kv_connector=None, structured=None,
                   **overrides) -> Scheduler:
    config = dict(max_num_batched_tokens=32, max_num_seqs=16, max_model_len=4000, block_size=BLOCK)
    config.update(overrides)
    return Scheduler(unchecked_scheduler_config(**config), num_blocks, predictor, **({"clock": clock} if clock else {}),
                     kv_connector=kv_connector, structured=structured)


def unchecked_scheduler_config(**fields) -> SchedulerConfig:
    """A SchedulerConfig built without its checks: these tests also pin the scheduler's behaviour
    on budgets the engine refuses (below max_num_seqs or one block, a whole prompt that does not
    fit a step without chunking)."""
    config = object.__new__(SchedulerConfig)
    for f in dataclasses.fields(SchedulerConfig):
        object.__setattr__(config, f.name, fields.pop(f.name) if f.name in fields else f.default)
    assert not fields, f"SchedulerConfig has no fields {sorted(fields)}"
    return config


def make_request(request_id: str, prompt_len: int, max_tokens: int = 8, priority: int = 0,
                 arrival: float = 0.0) -> Request:
    prompt = [(zlib.crc32(request_id.encode()) + i) % 997 + 1 for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   eos_token_id=EOS, priority=priority, arrival_time=arrival)


def fake_model(tokens: list[int]) -> int:
    """The fake runner's "model": the next token, a deterministic function of the history."""
    return (sum(tokens) * 31 + len(tokens)) % 997 + 1


class FakeRunner:
    """Keeps each request's token history and block table (from the scheduler's diffs), as
    the real worker does. With `speculate`, it also proposes 0-4 draft tokens per decode,
    each right (the model's own continuation) with probability `draft_accuracy`, and verifies
    them as a real runner does: drafts are accepted while they equal the model's token, then
    the model's own token follows; so every accepted run has a random length."""

    def __init__(self, block_size: int = BLOCK, speculate: bool = False, draft_accuracy: float = 0.7,
                 seed: int = 0) -> None:
        self.block_size = block_size
        self.slots: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.num_computed = 0  # tokens computed over all steps
        self.tokens: dict[str, list[int]] = {}
        self.tables: dict[str, list[int]] = {}
        self.speculate = speculate
        self.draft_accuracy = draft_accuracy
        self.rng = random.Random(seed)
        self.num_drafted = self.num_accepted = 0

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in output.finished_request_ids:
            self.tokens.pop(request_id)
            self.tables.pop(request_id, None)
        for new in output.new_requests:
            self.tokens[new.request_id] = list(new.prompt_token_ids)
        result = ModelRunnerOutput({})
        for s in output.scheduled:
            table = [] if s.resets_block_table else self.tables[s.request_id]
            self.tables[s.request_id] = table + s.new_block_ids
            tokens = self.tokens[s.request_id]
            inputs = tokens + s.draft_token_ids
            self.num_computed += s.num_scheduled_tokens
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + s.num_scheduled_tokens):
                self.slots[self.slot(s.request_id, pos)] = (pos, tuple(inputs[: pos + 1]))
            if s.sample:
                end = s.num_computed_tokens + s.num_scheduled_tokens - len(s.draft_token_ids)
                assert end == len(tokens), "sampling before the whole history is computed"
                for pos in range(end):
                    assert self.slots[self.slot(s.request_id, pos)] == (pos, tuple(tokens[: pos + 1])), (
                        f"{s.request_id}: KV of position {pos} is wrong")
                accepted = self.verify(tokens, s.draft_token_ids)
                tokens.extend(accepted)
                result.sampled_token_ids[s.request_id] = accepted
                if self.speculate:
                    result.draft_token_ids[s.request_id] = self.propose(tokens)
        return result

    def verify(self, tokens: list[int], drafts: list[int]) -> list[int]:
        accepted = []
        for draft in drafts:
            if draft != fake_model(tokens + accepted):
                break
            accepted.append(draft)
        self.num_drafted += len(drafts)
        self.num_accepted += len(accepted)
        return accepted + [fake_model(tokens + accepted)]

    def propose(self, tokens: list[int]) -> list[int]:
        drafts: list[int] = []
        for _ in range(self.rng.randint(0, 4)):
            right = fake_model(tokens + drafts)
            drafts.append(right if self.rng.random() < self.draft_accuracy else right % 997 + 1)
        return drafts

    def slot(self, request_id: str, pos: int) -> int:
        table = self.tables[request_id]
        return table[pos // self.block_size] * self.block_size + pos % self.block_size


def run(scheduler: Scheduler, requests: list[Request], check=None, max_steps: int = 10_000,
        runner: FakeRunner | None = None) -> dict[str, list[int]]:
    """Step until every request finishes; `check(scheduler, output)` runs on every step. Pass
    the `runner` (the simulated KV) to keep using a scheduler, and so its prefix cache."""
    runner = runner or FakeRunner(scheduler.config.block_size)
    for request in requests:
        scheduler.add_request(request)
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        assert output.num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
        assert len(output.scheduled) <= scheduler.config.max_num_seqs
        if check:
            check(scheduler, output)
        scheduler.update_from_output(output, runner.execute(output))
    assert not scheduler.has_unfinished_requests(), "requests never finished"
    assert_pool_free(scheduler)
    return {r.request_id: r.output_token_ids for r in requests}


def assert_pool_free(scheduler: Scheduler) -> None:
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks, "KV blocks leaked"


def assert_references_match_tables(scheduler: Scheduler, output=None) -> None:
    """Every block's reference count is the number of running requests holding it, only
    blocks nobody holds are free (so eviction can never take a block in use), and a step
    writes KV only into blocks that one request holds and no cache entry names."""
    pool = scheduler.kv.pool
    for s in output.scheduled if output is not None else []:
        first, last = s.num_computed_tokens // BLOCK, (s.num_computed_tokens + s.num_scheduled_tokens - 1) // BLOCK
        for block_id in scheduler.kv.block_table(s.request_id)[first : last + 1]:
            assert pool.ref_count(block_id) == 1 and not pool.is_cached(block_id), f"{s.request_id} writes a shared block"
    holders = [0] * pool.num_blocks
    for r in scheduler.running:
        for block_id in scheduler.kv.block_table(r.request_id):
            holders[block_id] += 1
    assert [pool.ref_count(b) for b in range(pool.num_blocks)] == holders
    assert pool.num_free_blocks == holders.count(0)


def forge(files: BlockFiles, block_hash: bytes, kind: str) -> None:
    """Damage `block_hash`'s file as `kind` says."""
    path = files.path(block_hash)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    payload = bytes(data[HEADER.size:])
    if kind == "truncated":
        data = data[: len(data) - 100]
    elif kind == "flipped_payload_byte":
        data[HEADER.size + 1234] ^= 0x01
    elif kind == "wrong_fingerprint":  # another model's weights wrote it
        other = dataclasses.replace(files.fingerprint, weights_hash="x" * 64).digest()
        data[: HEADER.size] = files.header(block_hash, zlib.crc32(payload), digest=other)
    elif kind == "wrong_block_size":
        layout = dataclasses.replace(files.layout, block_size=files.layout.block_size * 2)
        data[: HEADER.size] = files.header(block_hash, zlib.crc32(payload), layout=layout)
    elif kind == "bad_magic":
        data[:8] = b"NOTKVBLK"
    elif kind == "another_blocks_file":
        data[: HEADER.size] = files.header(some_hash(999), zlib.crc32(payload))
    elif kind == "longer":
        data += b"\0" * 16
    else:
        raise ValueError(kind)
    with open(path, "wb") as f:
        f.write(data)


def some_hash(i: int) -> bytes:
    return zlib.crc32(str(i).encode()).to_bytes(4, "little") * 8


class FakeRemoteConnector(KVConnectorScheduler):
    """Requests named remote-* find all but their last block elsewhere, loaded asynchronously;
    every finished request's blocks are sent before they may be freed."""

    def __init__(self) -> None:
        self.to_load: dict[str, tuple[list[int], int]] = {}  # request id -> (block ids, tokens)
        self.sending: list[str] = []
        self.external: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if not request.request_id.startswith("remote") or request.num_preemptions:
            return 0, False
        available = (request.num_tokens - 1) // BLOCK * BLOCK - num_computed_tokens
        return max(available, 0), True

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        self.external[request.request_id] = num_external_tokens
        self.to_load[request.request_id] = (list(block_ids), request.num_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> dict:
        meta = {"load": self.to_load, "send": self.sending}
        self.to_load, self.sending = {}, []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self.sending.append(request.request_id)
        return True, {"blocks": list(block_ids)}


class ConnectedRunner(FakeRunner):
    """The fake runner plus the connector's worker side: loads land in the slots (the KV the
    request's own prefill would have written), sends finish the step after they are asked for."""

    def __init__(self, prompts: dict[str, list[int]]) -> None:
        super().__init__()
        self.prompts = prompts

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        result = super().execute(output)
        meta = output.kv_connector_metadata
        for request_id, (block_ids, num_tokens) in meta["load"].items():
            self.tables[request_id] = block_ids
            prompt = self.prompts[request_id]
            for pos in range((num_tokens - 1) // BLOCK * BLOCK):
                self.slots[self.slot(request_id, pos)] = (pos, tuple(prompt[: pos + 1]))
            result.finished_recving.add(request_id)
        result.finished_sending.update(meta["send"])
        return result

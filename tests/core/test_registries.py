"""No request outlives its finish anywhere: every per-request registry of the scheduler and its
collaborators (`Scheduler.registry_sizes()`) is empty once every request has finished, been
aborted (waiting, in the middle of its prompt or its decode, loading its KV, with its token in
flight, new in a step that failed) or been preempted on the way, for each feature that keeps
state of its own (prefix caching, chunking, n-gram and draft-model drafts, structured outputs,
steps in flight, failed steps, a KV connector, images in the encoder cache); the worker's view agrees (the fake runner
holds no request either); and an entry left behind is reported (`Scheduler.leaks()`, which the
engine's self-check asks when idle)."""

from __future__ import annotations

import random
from collections import deque

import numpy as np
import pytest

from chunkserve.config.model import resolve_model
from chunkserve.config.speculative import SpeculativeConfig
from chunkserve.core.messages import ModelRunnerOutput, SchedulerOutput
from chunkserve.core.request import Request, RequestStatus
from chunkserve.core.sched.scheduler import NEXT_STEP_MESSAGE, Scheduler
from chunkserve.core.structured.manager import StructuredOutputManager
from chunkserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.core.mm_support import EncoderRunner, image, image_request
from tests.core.support import (
    EOS,
    ConnectedRunner,
    FakeRemoteConnector,
    FakeRunner,
    make_request,
    make_scheduler,
)

NGRAM = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                                 "prompt_lookup_max": 3})  # auto: per-request acceptance rates
DRAFT_MODEL = SpeculativeConfig.parse({"method": "draft_model", "model": "/models/draft",
                                       "num_speculative_tokens": 4})  # (the fake runner drafts up to 4)
FAIL_EVERY = 4
TINY_POOL = 18  # blocks of 4 tokens: one request fits alone (<= 40 + 10 tokens, drafts ahead), a few preempt
SHARED = list(range(500, 524))  # six blocks every request of the prefix scenario starts with


def prompts(seed: int, n: int = 10) -> list[tuple[str, int, int]]:
    rng = random.Random(seed)
    return [(f"r{i}", rng.randint(5, 40), rng.randint(1, 10)) for i in range(n)]


def plain_requests(seed: int) -> list[Request]:
    return [make_request(rid, prompt_len, max_tokens) for rid, prompt_len, max_tokens in prompts(seed)]


def prefixed_requests(seed: int) -> list[Request]:
    return [Request(r.request_id, SHARED + r.prompt_token_ids[:16], r.sampling_params, eos_token_id=EOS,
                    arrival_time=0.0) for r in plain_requests(seed)]


def image_requests(seed: int) -> list[Request]:
    """Most prompts hold an image, one of a few, so images are shared, cached and evicted."""
    requests = []
    for i, (request_id, prompt_len, max_tokens) in enumerate(prompts(seed)):
        length = min(16, prompt_len - 4)
        images = [(f"img{i % 3}-{length}", 2, length)] if length > 0 else []
        requests.append(image_request(request_id, prompt_len, images, max_tokens, text_seed=request_id))
    return requests


def periodic_requests(seed: int) -> list[Request]:
    """Prompts that repeat, so the n-gram proposer finds drafts."""
    return [Request(r.request_id, (r.prompt_token_ids[:3] * 14)[: r.num_prompt_tokens], r.sampling_params,
                    eos_token_id=EOS, arrival_time=0.0) for r in plain_requests(seed)]


def remote_requests(seed: int) -> list[Request]:
    """Every other request finds its KV elsewhere (the fake connector loads it)."""
    return [make_request(f"remote-{r.request_id}" if i % 2 else r.request_id, r.num_prompt_tokens, r.max_tokens)
            for i, r in enumerate(plain_requests(seed))]


class PeriodicRunner(FakeRunner):
    """Its model repeats the token three back, so a periodic request's n-gram drafts hold."""

    def verify(self, tokens: list[int], drafts: list[int]) -> list[int]:
        accepted: list[int] = []
        for draft in drafts:
            if draft != (tokens + accepted)[-3]:
                break
            accepted.append(draft)
        return accepted + [(tokens + accepted)[-3]]


class MaskedRunner(FakeRunner):
    """The fake runner, sampling inside each row's grammar bitmask (the model's token if the
    grammar allows it, else the lowest token it allows)."""

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        self.masks = deque(s.grammar_bitmask for s in output.scheduled if s.sample)
        return super().execute(output)

    def verify(self, tokens: list[int], drafts: list[int]) -> list[int]:
        accepted = super().verify(tokens, drafts)
        mask = self.masks.popleft()
        if mask is not None:
            allowed = np.flatnonzero(np.unpackbits(mask[-1].astype("<i4").view(np.uint8), bitorder="little"))
            if allowed.size and accepted[-1] not in allowed:
                accepted[-1] = int(allowed[0])
        return accepted


class SlowConnectedRunner(ConnectedRunner):
    """Reports each load one step after it was asked for, so a request waits for its KV across
    steps; the load of a request that finished meanwhile is cancelled, never reported."""

    def __init__(self, prompts: dict[str, list[int]]) -> None:
        super().__init__(prompts)
        self.landing: set[str] = set()

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        result = super().execute(output)
        result.finished_recving, self.landing = self.landing - set(output.kv_connector_metadata["send"]), \
            result.finished_recving
        return result


class FailedStepsRunner(FakeRunner):
    """Never gets the steps that failed, so it may be told to forget a request it never had:
    it forgets it anyway, as the model runner does."""

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in output.finished_request_ids:
            self.tokens.setdefault(request_id, [])
        return super().execute(output)


class FailedStepsEncoderRunner(EncoderRunner, FailedStepsRunner):
    """Both: the encoder outputs of a failed step are encoded again when needed."""


@pytest.fixture(scope="module")
def tokenizer():
    from chunkserve.engine.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(None))


def structured_requests(seed: int, eos: int) -> list[Request]:
    """Grammars of each kind that finish (a choice, a regex), and one that never compiles."""
    kinds = [StructuredOutputsParams(choice=["yes", "no"]), StructuredOutputsParams(regex="[0-9]{2,4}"), None]
    requests = []
    for i, r in enumerate(plain_requests(seed)):
        params = SamplingParams(max_tokens=r.max_tokens + 6, structured_outputs=kinds[i % 3])
        requests.append(Request(r.request_id, r.prompt_token_ids, params, eos_token_id=eos, arrival_time=0.0))
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[a-"))
    return requests + [Request("bad-grammar", [7] * 9, bad, eos_token_id=eos, arrival_time=0.0)]


FEATURES = {  # name -> (scheduler overrides, pipeline depth)
    "plain": ({}, 1),
    "prefix_cached": ({}, 1),
    "chunked": ({"max_num_batched_tokens": 12}, 1),
    "ngram": ({"speculative": NGRAM}, 1),
    "draft_model": ({"speculative": DRAFT_MODEL}, 1),
    "pipelined": ({"max_steps_in_flight": 2, "tokens_from_steps": True}, 2),
    "failing_steps": ({}, 1),  # every FAIL_EVERY-th step fails: what it carried is sent again
    "kv_connector": ({}, 1),
    "structured": ({}, 1),
    "multimodal": ({"max_tokens_per_mm_item": 16, "encoder_cache_size": 24, "max_num_batched_tokens": 12}, 1),
    "multimodal_failing_steps": ({"max_tokens_per_mm_item": 16, "max_num_batched_tokens": 12}, 1),
}


class Aborter:
    """Aborts, once each, a request of each kind in `kinds` as soon as one is found."""

    KINDS = {
        "waiting": lambda scheduler, r: r.status == RequestStatus.WAITING,
        "mid_prompt": lambda scheduler, r: r.status == RequestStatus.RUNNING and 0 < r.num_computed_tokens < r.num_prompt_tokens,
        "mid_decode": lambda scheduler, r: r.status == RequestStatus.RUNNING and r.num_output_tokens > 0,
        "loading_kv": lambda scheduler, r: r.status == RequestStatus.WAITING_FOR_REMOTE_KVS,
        # pipelined: its step's result comes back after it finished
        "token_in_flight": lambda scheduler, r: scheduler.sent.is_awaiting_token(r.request_id),
        # new in a step that failed: the worker may lack it, so it is to be sent again
        "resent": lambda scheduler, r: r.status == RequestStatus.RUNNING and not scheduler.sent.has_state(r.request_id),
    }

    def __init__(self, kinds: list[str]) -> None:
        self.kinds = kinds
        self.done: set[str] = set()

    def __call__(self, scheduler: Scheduler) -> None:
        for kind in self.kinds:
            victim = next((r for r in scheduler.requests.values() if self.KINDS[kind](scheduler, r)), None)
            if kind not in self.done and victim is not None:
                scheduler.finish_requests([victim.request_id], RequestStatus.FINISHED_ABORTED)
                self.done.add(kind)


def drive(scheduler: Scheduler, runner: FakeRunner, requests: list[Request], depth: int, on_step=None,
          manager: StructuredOutputManager | None = None, fail_every: int = 0, max_steps: int = 5000) -> None:
    """Step (with up to `depth` steps in flight, as the engine does) until nothing is unfinished;
    `on_step(scheduler)` runs before each round; with `fail_every`, the step of every such round
    fails before it reaches the worker (void)."""
    for request in requests:
        scheduler.add_request(request)
    in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    for count in range(1, max_steps):
        if not scheduler.has_unfinished_requests() and not in_flight:
            break
        if on_step:
            on_step(scheduler)
        while len(in_flight) < depth:
            output = scheduler.schedule()
            if output.is_empty and in_flight:  # its finished ids ride the next step (EngineCore's way)
                scheduler.void_step(output)
                break
            if fail_every and count % fail_every == 0 and not output.is_empty:
                scheduler.void_step(output)  # (its forward raised)
                break
            in_flight.append((output, runner.execute(output)))
            if output.is_empty:
                break
        if not in_flight:
            continue
        output, result = in_flight.popleft()
        scheduler.update_from_output(output, result)
        if output.is_empty and manager is not None:
            manager.wait_for_compiles(0.05)
    assert not scheduler.has_unfinished_requests() and not in_flight, "requests never finished"


def assert_no_registry_left(scheduler: Scheduler, runner: FakeRunner) -> None:
    assert scheduler.leaks() == []  # what the engine's self-check asks when idle
    sizes = scheduler.registry_sizes()
    assert {name: size for name, size in sizes.items() if size and name != NEXT_STEP_MESSAGE} == {}
    output = scheduler.schedule()  # an empty step: it tells the worker the last finished requests
    assert output.is_empty
    scheduler.update_from_output(output, runner.execute(output))
    assert {name: size for name, size in scheduler.registry_sizes().items() if size} == {}
    assert runner.tokens == {}, "the worker still holds requests the scheduler finished"
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks


def setup(feature: str, seed: int, num_blocks: int, tokenizer=None):
    overrides, depth = FEATURES[feature]
    manager = connector = None
    if feature == "structured":
        manager = StructuredOutputManager(lambda: tokenizer, len(tokenizer))
        requests = structured_requests(seed, tokenizer.eos_token_id)
    elif feature == "kv_connector":
        connector = FakeRemoteConnector()
        requests = remote_requests(seed)
    else:
        make = {"prefix_cached": prefixed_requests, "ngram": periodic_requests, "multimodal": image_requests,
                "multimodal_failing_steps": image_requests}.get(feature, plain_requests)
        requests = make(seed)
    scheduler = make_scheduler(num_blocks=num_blocks, kv_connector=connector, structured=manager, **overrides)
    if feature == "kv_connector":
        runner = SlowConnectedRunner({r.request_id: list(r.prompt_token_ids) for r in requests})
    elif feature == "structured":
        runner = MaskedRunner()
    elif feature == "failing_steps":
        runner = FailedStepsRunner()
    elif feature.startswith("multimodal"):
        runner = FailedStepsEncoderRunner() if feature.endswith("failing_steps") else EncoderRunner()
    elif feature == "ngram":
        runner = PeriodicRunner()
    else:
        runner = FakeRunner(speculate=feature == "draft_model")
    return scheduler, runner, requests, depth, manager


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("ending", ["complete", "abort", "preempt"])
def test_every_registry_is_empty_once_every_request_has_ended(feature, ending, request):
    tokenizer = request.getfixturevalue("tokenizer") if feature == "structured" else None
    scheduler, runner, requests, depth, manager = setup(feature, 3, TINY_POOL if ending == "preempt" else 1000,
                                                        tokenizer)
    kinds = ["waiting", "mid_prompt", "mid_decode"] + {"kv_connector": ["loading_kv"], "pipelined": ["token_in_flight"],
                                                         "failing_steps": ["resent"]}.get(feature, [])
    failing = feature.endswith("failing_steps")
    aborter = Aborter(kinds) if ending == "abort" else None
    try:
        drive(scheduler, runner, requests, depth, aborter, manager, FAIL_EVERY if failing else 0)
        assert_no_registry_left(scheduler, runner)
    finally:
        if manager is not None:
            manager.shutdown()
    if aborter is not None:
        assert aborter.done == set(kinds), f"no request was found to abort as {set(kinds) - aborter.done}"
    if ending == "preempt":
        assert scheduler.num_preemptions > 0, "the pool was meant to preempt"
    if ending == "complete":
        assert all(r.status != RequestStatus.FINISHED_ABORTED for r in requests if r.request_id != "bad-grammar")
    if feature == "prefix_cached" and ending == "complete":
        assert scheduler.prefix_cache_hits > 0
    if feature in ("ngram", "draft_model"):
        assert scheduler.stats().spec_decode.num_draft_tokens > 0
    if feature.startswith("multimodal"):
        assert scheduler.stats().encoder_inputs_total > 0


@pytest.mark.parametrize("plant", ["chunking", "kv", "sent", "drafting", "encoder"])
def test_an_entry_left_behind_is_reported(plant):
    scheduler = make_scheduler(speculative=NGRAM)
    assert scheduler.leaks() == []
    if plant == "chunking":
        scheduler.chunking.track("ghost", 0.0)
    elif plant == "kv":
        scheduler.kv.allocate_slots("ghost", 5)
    elif plant == "sent":
        scheduler.sent.block_diff("ghost", [3])
    elif plant == "encoder":
        scheduler.encoder.cache.allocate("ghost", image("x", 0, 3))
    else:
        scheduler.drafting.policy.set_shadow("ghost", 7)
    leaks = scheduler.leaks()
    assert leaks and all(problem.startswith(f"{plant}.") for problem in leaks), leaks

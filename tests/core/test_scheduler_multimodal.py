"""Images in the chunked-prefill scheduler (encoder_inputs.py, encoder_cache.py): the encoder runs
once per image, when the first chunk reaches it, within the step's encoder budget and the encoder
cache; --disable-chunked-mm-input keeps each image in one chunk; the prefix cache tells images
apart; references end with their requests. The fake runner (mm_support.EncoderRunner) plays the
worker's encoder cache and asserts that every chunk finds the outputs it needs."""

from __future__ import annotations

import hashlib
from array import array

import numpy as np
import pytest

from chunkserve.config.engine import EngineArgs
from chunkserve.config.scheduler import SchedulerConfig
from chunkserve.core.kv.kv_cache_manager import ROOT_HASH
from chunkserve.core.request import RequestStatus
from chunkserve.core.step_predictor import StepShape, StepTimePredictor
from chunkserve.errors import InvalidRequestError
from tests.core.mm_support import EncoderRunner, image, image_request
from tests.core.support import make_request, make_scheduler, run

ITEM = 24  # the model's most placeholder tokens per image in these tests


def mm_scheduler(**overrides):
    return make_scheduler(**{"max_tokens_per_mm_item": ITEM, **overrides})


def step(scheduler, runner):
    output = scheduler.schedule()
    scheduler.update_from_output(output, runner.execute(output))
    return output


def chunks_of(outputs, request_id):
    """(start, tokens, encoder inputs) of each step's share of the request."""
    return [(s.num_computed_tokens, s.num_scheduled_tokens, s.encoder_inputs)
            for output in outputs for s in output.scheduled if s.request_id == request_id]


def run_recording(scheduler, runner, requests):
    outputs = []
    run(scheduler, requests, check=lambda _, output: outputs.append(output), runner=runner)
    return outputs


def test_an_image_is_encoded_once_across_chunks_and_then_found_in_the_cache():
    scheduler = mm_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=8, max_num_partial_prefills=2,
                             max_long_partial_prefills=2, encoder_cache_size=64)  # two prompts, 8 tokens each per step
    runner = EncoderRunner()
    first = image_request("first", 40, [("cat", 6, 20)])
    outputs = run_recording(scheduler, runner, [first])
    chunks = chunks_of(outputs, "first")
    assert len([c for c in chunks if c[0] < 26]) >= 4, "the image's range spans 3+ chunks"
    assert [c[2] for c in chunks] == [[0]] + [[]] * (len(chunks) - 1), "encoded with the first chunk that reaches it"
    assert runner.encodes_of("first") == ["cat"]
    assert sum(o.num_encoder_inputs for o in outputs) == 1 and sum(o.num_encoder_embeds for o in outputs) == 20

    # while it runs and after it finished (its output kept, unreferenced), the same image is not encoded again
    running_twin = image_request("running-twin", 30, [("dog", 2, 12)], text_seed="a")
    twin = image_request("twin", 30, [("dog", 2, 12)], text_seed="b")
    again = image_request("again", 40, [("cat", 10, 20)], text_seed="c")
    outputs, shared = [], []

    def check(scheduler, output):
        outputs.append(output)
        shared.append(all(scheduler.encoder.cache.holds("dog", r) for r in ("running-twin", "twin")))

    run(scheduler, [running_twin, twin, again], check, runner=runner)
    assert any(shared), "twin found dog while running-twin still needed it"
    assert runner.encodes_of("twin") == [] and runner.encodes_of("again") == []
    assert runner.encodes_of("running-twin") == ["dog"]
    assert sum(o.encoder_cache_hits for o in outputs) == 2
    stats = scheduler.stats()
    assert (stats.encoder_inputs_total, stats.encoder_embeds_total, stats.encoder_cache_hits_total) == (2, 32, 2)
    assert scheduler.leaks() == []


@pytest.mark.parametrize("budget", [1, 3, 5, 8])
def test_chunks_cut_through_images_compute_every_position_once(budget):
    """Down to 1-token chunks: each image is encoded at the first chunk that reaches it, once,
    even when it appears twice in the prompt."""
    scheduler, runner = mm_scheduler(max_num_batched_tokens=budget), EncoderRunner()
    request = image_request("r", 50, [("a", 3, 10), ("b", 17, 7), ("a", 30, 10)], max_tokens=2)
    chunks = chunks_of(run_recording(scheduler, runner, [request]), "r")
    prompt_chunks = [c for c in chunks if c[0] < 50]
    positions = [p for start, n, _ in prompt_chunks for p in range(start, start + n)]
    assert positions == list(range(50)), "every prompt position exactly once, in order"
    encoded_at = {start: inputs for start, _, inputs in prompt_chunks if inputs}
    first_touch = {i: next(start for start, n, _ in prompt_chunks if f.overlaps(start, start + n))
                   for i, f in enumerate(request.mm_features)}
    assert encoded_at == {first_touch[0]: [0], first_touch[1]: [1]}
    assert runner.encodes_of("r") == ["a", "b"]


def test_an_image_the_encoder_budget_cannot_take_waits_and_the_text_before_it_goes():
    scheduler = mm_scheduler(max_num_batched_tokens=40, max_num_batched_encoder_embeds=12, max_tokens_per_mm_item=12)
    runner = EncoderRunner()
    request = image_request("r", 60, [("a", 4, 12), ("b", 22, 12)], max_tokens=2)
    scheduler.add_request(request)
    first = step(scheduler, runner)
    assert chunks_of([first], "r") == [(0, 22, [0])], "the text before b (an unaligned chunk); b waits"
    second = step(scheduler, runner)
    assert chunks_of([second], "r")[0][::2] == (22, [1])
    run(scheduler, [], runner=runner)
    assert runner.encodes_of("r") == ["a", "b"]


def test_an_image_the_encoder_cache_cannot_hold_waits_for_room():
    """Two requests' images fit the step's encoder budget but not the cache together: the second
    waits until the first's rows are in the KV cache (its output then unreferenced, evicted)."""
    scheduler = mm_scheduler(max_num_batched_tokens=64, encoder_cache_size=20, max_tokens_per_mm_item=20)
    runner = EncoderRunner()
    first, second = image_request("first", 40, [("a", 20, 20)]), image_request("second", 40, [("b", 0, 20)])
    for request in (first, second):
        scheduler.add_request(request)
    output = step(scheduler, runner)
    assert chunks_of([output], "first") == [(0, 40, [0])] and chunks_of([output], "second") == []
    output = step(scheduler, runner)
    assert chunks_of([output], "second") == [(0, 40, [0])] and output.free_encoder_ids == ["a"]
    run(scheduler, [], runner=runner)


def splits(outputs, request):
    """Chunks that end strictly inside an image's range."""
    return [(start, n) for start, n, _ in chunks_of(outputs, request.request_id) for f in request.mm_features
            if f.offset < start + n < f.end]


@pytest.mark.parametrize("overrides", [
    {"max_num_batched_tokens": 16},
    {"max_num_batched_tokens": 32, "long_prefill_token_threshold": 8},  # starts at an image with 8: vllm#52306
    {"max_num_batched_tokens": 14, "chunk_align": 8, "block_size": 4},  # alignment would cut the image
])
def test_disable_chunked_mm_input_never_splits_an_image(overrides):
    scheduler, runner = mm_scheduler(disable_chunked_mm_input=True, max_tokens_per_mm_item=12, **overrides), \
        EncoderRunner()
    requests = [image_request("r", 60, [("a", 8, 12), ("b", 22, 11), ("c", 40, 12)], max_tokens=2),
                image_request("s", 30, [("d", 1, 12)], text_seed="s")]
    outputs = run_recording(scheduler, runner, requests)
    assert [splits(outputs, r) for r in requests] == [[], []]
    assert runner.encodes_of("r") == ["a", "b", "c"]

    chunked, runner = mm_scheduler(max_tokens_per_mm_item=12, **overrides), EncoderRunner()
    alone = image_request("r", 60, [("a", 8, 12)])
    assert splits(run_recording(chunked, runner, [alone]), alone), "without the flag the same image is split"


def test_disable_chunked_mm_input_refuses_an_image_larger_than_a_step_at_start_up():
    message = ("Chunked MM input disabled but max_tokens_per_mm_item (40) is larger than max_num_batched_tokens "
               "(32). Please increase max_num_batched_tokens.")
    args = EngineArgs(max_num_batched_tokens=32, disable_chunked_mm_input=True)
    with pytest.raises(InvalidRequestError) as error:
        args.create_engine_config(4000, max_tokens_per_mm_item=40)
    assert str(error.value) == message
    config = EngineArgs(max_num_batched_tokens=32).create_engine_config(4000, max_tokens_per_mm_item=40).scheduler
    assert (config.encoder_compute_budget, config.encoder_cache_capacity) == (40, 40), "floored at one image"


def test_requests_that_could_never_run_are_refused_when_added():
    scheduler = mm_scheduler(encoder_cache_size=20, max_tokens_per_mm_item=10)
    with pytest.raises(InvalidRequestError, match="needs 30 encoder output rows, more than .* holds [(]20[)]") as error:
        scheduler.add_request(image_request("r", 40, [("a", 0, 30)]))
    assert error.value.param == "messages"
    with pytest.raises(InvalidRequestError, match="takes no images"):
        make_scheduler().add_request(image_request("r", 40, [("a", 0, 10)]))
    assert scheduler.requests == {}


def test_the_prefix_cache_tells_same_size_images_apart():
    scheduler, runner = mm_scheduler(max_num_batched_tokens=64), EncoderRunner()
    run(scheduler, [image_request("first", 40, [("cat", 8, 16)])], runner=runner)
    same, other = image_request("same", 40, [("cat", 8, 16)]), image_request("other", 40, [("dog", 8, 16)])
    assert same.prompt_token_ids == other.prompt_token_ids
    run(scheduler, [same, other], runner=runner)  # (the runner's KV check fails on another image's KV)
    assert same.num_cached_tokens == 36 and runner.encodes_of("same") == []
    assert other.num_cached_tokens == 8 and runner.encodes_of("other") == ["dog"]


def test_text_block_hashes_are_unchanged():
    scheduler = make_scheduler()
    request = make_request("text", 9)
    first = hashlib.sha256(ROOT_HASH + array("q", request.prompt_token_ids[:4]).tobytes()).digest()
    second = hashlib.sha256(first + array("q", request.prompt_token_ids[4:8]).tobytes()).digest()
    assert scheduler.kv.block_hashes_for(request, 2) == [first, second]


@pytest.mark.parametrize("ending", ["abort", "preempt"])
def test_abort_and_preemption_release_encoder_references(ending):
    scheduler, runner = mm_scheduler(max_num_batched_tokens=8, num_blocks=14), EncoderRunner()
    victim = image_request("victim", 40, [("cat", 4, 20)], max_tokens=12)
    scheduler.add_request(victim)
    for _ in range(2):
        step(scheduler, runner)
    assert scheduler.encoder.cache.holds("cat", "victim")
    if ending == "abort":
        scheduler.finish_requests(["victim"], RequestStatus.FINISHED_ABORTED)
        assert scheduler.registry_sizes()["encoder.references"] == 0 and scheduler.leaks() == []
        step(scheduler, runner)
        return
    # a second request with an image shares the pool: one is preempted, drops its references, and recomputes,
    # finding its image again or encoding it again (the runner asserts every chunk has its output)
    held_while_preempted = []

    def check(scheduler, output):
        held_while_preempted.extend(f.identifier for r in scheduler.waiting if r.status == RequestStatus.PREEMPTED
                                    for f in r.mm_features if scheduler.encoder.cache.holds(f.identifier, r.request_id))

    run(scheduler, [image_request("hog", 36, [("dog", 0, 20)], max_tokens=20, text_seed="h")], check, runner=runner)
    assert scheduler.num_preemptions > 0 and held_while_preempted == []
    assert scheduler.leaks() == [] and scheduler.check() == []


def test_text_decodes_keep_one_token_per_step_while_an_image_prompt_prefills():
    scheduler, runner = mm_scheduler(max_num_batched_tokens=16), EncoderRunner()
    texts = [make_request(f"text{i}", 6, max_tokens=40) for i in range(3)]
    for request in texts:
        scheduler.add_request(request)
    while not all(r.is_decoding for r in texts):
        step(scheduler, runner)
    scheduler.add_request(image_request("img", 80, [("cat", 10, 24), ("dog", 40, 24)], max_tokens=2))
    prefill_steps = 0
    while scheduler.requests["img"].num_computed_tokens < 80:
        output = step(scheduler, runner)
        assert [(s.request_id, s.num_scheduled_tokens) for s in output.scheduled if s.is_decode] == \
            [(r.request_id, 1) for r in texts]
        prefill_steps += 1
    assert prefill_steps >= 6
    run(scheduler, [], runner=runner)


def test_the_step_time_model_learns_the_encoder_and_the_slo_budget_charges_it():
    predictor = StepTimePredictor(refit_every=1)
    rng = np.random.default_rng(0)
    for _ in range(40):  # 2 ms + 1 ms per 100 prompt rows + 5 ms per 100 encoder rows
        rows, embeds = int(rng.integers(10, 200)), int(rng.integers(0, 200)) * int(rng.integers(0, 2))
        shape = StepShape().plus(0, rows).plus_encoder(embeds)
        predictor.observe(shape, 0.002 + rows * 1e-5 + embeds * 5e-5)
    assert predictor.predict(StepShape().plus_encoder(100)) == pytest.approx(0.002 + 0.005, rel=0.05)

    predictor = StepTimePredictor()
    predictor.coefficients = np.array([0.001, 0.01, 0.01, 0.0, 0.0, 0.0, 0.05, 0.0])  # s per 1k rows; 50 us per embed
    scheduler = mm_scheduler(max_num_batched_tokens=128, tbt_slo_ms=2.0, predictor=predictor)
    runner = EncoderRunner()
    scheduler.add_request(image_request("img", 100, [("cat", 40, 16)], max_tokens=2))
    outputs = [step(scheduler, runner) for _ in range(20)]
    assert all(o.predicted_duration_s <= 0.002 + 1e-9 for o in outputs if o.scheduled)
    encoding = [o for o in outputs if o.num_encoder_inputs]
    assert len(encoding) == 1 and encoding[0].num_encoder_embeds == 16
    assert encoding[0].predicted_duration_s == pytest.approx(
        predictor.predict(StepShape.of(encoding[0].scheduled, 16)))
    assert encoding[0].num_scheduled_tokens < max(o.num_scheduled_tokens for o in outputs), \
        "the step that encodes the image computes fewer prompt rows"


def test_scheduler_config_checks_the_encoder_flags():
    with pytest.raises(InvalidRequestError, match="encoder_cache_size must be positive"):
        SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8, max_model_len=100, block_size=4,
                        encoder_cache_size=0)
    assert image("x", 0, 3).num_embeds == 3


def test_the_ttft_slo_counts_the_images_a_prompt_still_has_to_encode():
    """10 ms + 1 ms per row: the image prompt's 80 rows make its 100 ms deadline, its 60 encoder rows
    (1 ms each) do not, so the text prompt that arrived after it goes first."""
    predictor = StepTimePredictor()
    predictor.coefficients = np.array([0.01, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    scheduler = mm_scheduler(max_num_batched_tokens=32, predictor=predictor, clock=lambda: 0.005, ttft_slo_ms=100,
                             max_tokens_per_mm_item=64)
    scheduler.add_request(image_request("img", 80, [("cat", 10, 60)]))
    text = make_request("text", 12)
    text.arrival_time = 0.005
    scheduler.add_request(text)
    assert scheduler.schedule().scheduled[0].request_id == "text"

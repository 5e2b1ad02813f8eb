"""A vision-language model through the runner: our decoder fed transformers' vision encoder's
rows gives transformers' logits, however the prompt is cut into chunks (through an image's
rows, down to one token a step), each image is encoded once, and Qwen2-VL's rows take M-RoPE
positions."""

from __future__ import annotations

import pytest
import torch

from chunkserve.core.messages import ScheduledRequest, SchedulerOutput
from chunkserve.errors import RequestFailedError
from tests.multimodal_models import build_vlm, random_image
from tests.multimodal_runner import MultiModalDriver, hf_inputs, hf_model

ATOL = 1e-4


@pytest.fixture(scope="module", params=["llava", "idefics3", "qwen2_vl"])
def vlm(request, tmp_path_factory):
    folder = build_vlm(request.param, str(tmp_path_factory.mktemp(request.param)))
    driver = MultiModalDriver(folder)
    token_ids, features = driver.process([random_image(1), random_image(2, 60, 30)])
    reference = hf_model(folder)
    with torch.inference_mode():
        expected = reference(**hf_inputs(token_ids, features)).logits[0]
    return request.param, driver, token_ids, features, reference, expected


@pytest.mark.parametrize("chunk", [1, 3, 16, 1000])
def test_chunked_prompt_logits_equal_transformers(vlm, chunk):
    _, driver, token_ids, features, _, expected = vlm
    logits, outputs = driver.prefill(f"chunk-{chunk}", token_ids, features, chunk)
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=1e-4)


def test_each_image_is_encoded_once_across_chunks(vlm):
    _, driver, token_ids, features, _, _ = vlm
    driver.runner.multimodal.cache.clear()
    _, outputs = driver.prefill("once", token_ids, features, chunk=3)
    steps_reaching = [next(i for i, start in enumerate(range(0, len(token_ids), 3)) if f.overlaps(start, start + 3))
                      for f in features]
    assert [i for i, o in enumerate(outputs) if o.num_encoder_calls] == steps_reaching
    assert sum(o.num_encoder_calls for o in outputs) == 2 and len(outputs) > 3
    assert all(o.encoder_seconds > 0 for o in outputs if o.num_encoder_calls)


def test_greedy_tokens_equal_transformers_generate(vlm):
    architecture, driver, token_ids, features, reference, _ = vlm
    if architecture != "qwen2_vl":
        pytest.skip("one model suffices; Qwen2-VL's also checks decode positions (position + delta)")
    steps = 32
    driver.prefill("greedy", token_ids, features, chunk=7, max_tokens=steps)
    ours = driver.decode("greedy", len(token_ids), steps - 1)
    with torch.inference_mode():
        generated = reference.generate(**hf_inputs(token_ids, features), max_new_tokens=steps, do_sample=False)
    theirs = generated[0, len(token_ids) :].tolist()
    assert ours[: len(theirs)] == theirs and len(theirs) > 1


def test_freed_encoder_outputs_leave_the_cache(vlm):
    _, driver, token_ids, features, _, _ = vlm
    cache = driver.runner.multimodal.cache
    assert {f.identifier for f in features} <= set(cache)
    driver.runner.execute(SchedulerOutput([], [], free_encoder_ids=[f.identifier for f in features]))
    assert not cache


def test_a_missing_encoder_output_fails_the_request(vlm):
    """A chunk reaching an image whose output is not cached (and not scheduled to be) is an error
    naming the request, never rows of the wrong embedding."""
    _, driver, token_ids, features, _, _ = vlm
    driver.runner.multimodal.cache.clear()
    # the first step schedules no encoder input: the image's rows have nothing to take
    end = features[0].end
    with pytest.raises(RequestFailedError) as error:
        driver.runner.execute(SchedulerOutput([ScheduledRequest("missing", 0, end, list(range(60, 64)), True, False,
                                                                False)],
                                              [_new("missing", token_ids, features)]))
    assert error.value.request_ids == ["missing"]


def _new(request_id, token_ids, features):
    from chunkserve.core.messages import NewRequestData
    from chunkserve.sampling_params import SamplingParams

    return NewRequestData(request_id, token_ids, SamplingParams(temperature=0.0, max_tokens=1), None,
                          mm_features=features)


def test_qwen2_vl_rows_take_m_rope_positions(vlm, monkeypatch):
    """Prompt rows at transformers' get_rope_index positions, whichever chunk they fall in; decodes
    at position + delta on all three axes; 1-D positions instead give other logits."""
    architecture, driver, token_ids, features, reference, expected = vlm
    if architecture != "qwen2_vl":
        pytest.skip("M-RoPE is Qwen2-VL's")
    inputs = hf_inputs(token_ids, features)
    rope, delta = reference.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                 image_grid_thw=inputs["image_grid_thw"])
    driver.positions.clear()
    driver.prefill("mrope", token_ids, features, chunk=5, max_tokens=3)
    assert torch.equal(torch.cat(driver.positions, dim=1), rope[:, 0])
    driver.positions.clear()
    driver.decode("mrope", len(token_ids), 2)
    first_decode = len(token_ids) + int(delta)
    assert [p.tolist() for p in driver.positions] == [[[first_decode + i]] * 3 for i in range(2)]
    assert int(delta) < 0  # images take fewer positions than tokens: the control below is not the same run
    monkeypatch.setattr(driver.encoder, "uses_mrope", False)
    logits, _ = driver.prefill("one-d", token_ids, features, chunk=1000)
    assert (logits - expected).abs().max() > 1e-4

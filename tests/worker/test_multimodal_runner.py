"""A vision-language model through the runner: our decoder fed transformers' vision encoder's
rows gives transformers' logits, however the prompt is cut into chunks (through an image's
rows, down to one token a step), each image is encoded once, and Qwen2-VL's rows take M-RoPE
positions."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass

import pytest
import torch

from chunkserve.core.messages import ScheduledRequest, SchedulerOutput
from chunkserve.errors import RequestFailedError
from tests.multimodal_models import ARCHITECTURES, random_image
from tests.multimodal_runner import MultiModalDriver, hf_inputs, hf_model, new_request, vlm_folder

ATOL = 1e-4


@dataclass
class Setup:
    architecture: str
    driver: MultiModalDriver
    token_ids: list[int]  # the prompt, two images expanded in it
    features: list
    reference: object  # transformers' model
    expected: torch.Tensor  # its logits of the prompt


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    """Each model built once for the module, when a test first asks for it."""
    built: dict[str, Setup] = {}

    def setup(architecture: str) -> Setup:
        if architecture not in built:
            folder = vlm_folder(tmp_path_factory, architecture)
            driver = MultiModalDriver(folder)
            token_ids, features = driver.process([random_image(1), random_image(2, 60, 30)])
            reference = hf_model(folder)
            with torch.inference_mode():
                expected = reference(**hf_inputs(token_ids, features)).logits[0]
            built[architecture] = Setup(architecture, driver, token_ids, features, reference, expected)
        return built[architecture]

    return setup


@pytest.fixture(params=ARCHITECTURES)
def vlm(request, setups) -> Setup:
    return setups(request.param)


@pytest.fixture
def qwen2_vl(setups) -> Setup:
    """Qwen2-VL: M-RoPE, so its decodes also check position + delta."""
    return setups("qwen2_vl")


@pytest.mark.parametrize("chunk", [1, 3, 16, 1000])
def test_chunked_prompt_logits_equal_transformers(vlm, chunk):
    """...with each image encoded once, in the step of the first chunk that reaches it."""
    vlm.driver.runner.multimodal.cache.clear()
    logits, outputs = vlm.driver.prefill(f"chunk-{chunk}", vlm.token_ids, vlm.features, chunk)
    torch.testing.assert_close(logits, vlm.expected, atol=ATOL, rtol=1e-4)
    starts = range(0, len(vlm.token_ids), chunk)
    reaching = [next(i for i, start in enumerate(starts) if f.overlaps(start, start + chunk)) for f in vlm.features]
    assert [o.num_encoder_calls for o in outputs] == [reaching.count(i) for i in range(len(outputs))]
    assert all(o.encoder_seconds > 0 for o in outputs if o.num_encoder_calls)


def test_greedy_tokens_equal_transformers_generate(qwen2_vl):
    driver, token_ids, features, reference = qwen2_vl.driver, qwen2_vl.token_ids, qwen2_vl.features, qwen2_vl.reference
    steps = 32
    driver.prefill("greedy", token_ids, features, chunk=7, max_tokens=steps)
    ours = driver.decode("greedy", len(token_ids), steps - 1)
    with torch.inference_mode():
        generated = reference.generate(**hf_inputs(token_ids, features), max_new_tokens=steps, do_sample=False)
    theirs = generated[0, len(token_ids) :].tolist()
    assert ours[: len(theirs)] == theirs and len(theirs) > 1


def test_freed_encoder_outputs_leave_the_cache(vlm):
    vlm.driver.prefill("to-free", vlm.token_ids, vlm.features, chunk=1000)
    cache = vlm.driver.runner.multimodal.cache
    assert {f.identifier for f in vlm.features} <= set(cache)
    vlm.driver.runner.execute(SchedulerOutput([], [], free_encoder_ids=[f.identifier for f in vlm.features]))
    assert not cache


def test_a_missing_encoder_output_fails_the_request(vlm):
    """A chunk reaching an image whose output is not cached (and not scheduled to be) is an error
    naming the request, never rows of the wrong embedding."""
    vlm.driver.runner.multimodal.cache.clear()
    # the step reaches the first image but schedules no encoder input: its rows have nothing to take
    step = ScheduledRequest("missing", 0, vlm.features[0].end, vlm.driver.blocks_for(len(vlm.token_ids)), True,
                            False, False)
    with pytest.raises(RequestFailedError) as error:
        vlm.driver.runner.execute(SchedulerOutput([step], [new_request("missing", vlm.token_ids, vlm.features)]))
    assert error.value.request_ids == ["missing"]


def test_qwen2_vl_rows_take_m_rope_positions(qwen2_vl, monkeypatch):
    """Prompt rows at transformers' get_rope_index positions, whichever chunk they fall in; decodes
    at position + delta on all three axes; 1-D positions instead give other logits."""
    driver, token_ids, features, reference = qwen2_vl.driver, qwen2_vl.token_ids, qwen2_vl.features, qwen2_vl.reference
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
    assert (logits - qwen2_vl.expected).abs().max() > 1e-4


def test_idefics3_image_split_into_crops(tmp_path, tmp_path_factory):
    """Splitting an image into crops puts row/column markers among its image tokens: a chunk
    takes encoder rows only at the image tokens, wherever it is cut."""
    folder = shutil.copytree(vlm_folder(tmp_path_factory, "idefics3"), tmp_path / "idefics3")
    config_path = folder / "processor_config.json"
    config = json.loads(config_path.read_text())
    config["image_processor"].update(do_image_splitting=True, size={"longest_edge": 64})
    config_path.write_text(json.dumps(config))
    driver = MultiModalDriver(folder)
    token_ids, features = driver.process([random_image(1, 64, 40), random_image(2, 30, 64)])
    assert all(0 < f.num_embeds < f.length for f in features)
    with torch.inference_mode():
        expected = hf_model(folder)(**hf_inputs(token_ids, features)).logits[0]
    logits, _ = driver.prefill("crops", token_ids, features, chunk=3)
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=1e-4)

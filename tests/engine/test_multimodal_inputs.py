"""A prompt with images through the frontend's input processor: a chat's image parts (data URLs,
PIL images) and the offline API's multi_modal_data give an EngineCoreRequest whose token ids and
features are the model's processor's, its expanded placeholder tokens count against
max_model_len, and what the model or the flags do not allow is a 400 naming the part, before
any engine work."""

from __future__ import annotations

import pytest

from chunkserve.config.limits import RequestLimits
from chunkserve.config.model import ModelSource, resolve_model
from chunkserve.config.multimodal import MultiModalConfig
from chunkserve.engine.frontend import multimodal_processor
from chunkserve.engine.input_processor import InputProcessor, MultiModalPrompt
from chunkserve.engine.messages import EngineInfo
from chunkserve.engine.tokenizer import load_tokenizer
from chunkserve.entrypoints.llm import engine_prompt
from chunkserve.errors import InvalidRequestError
from chunkserve.sampling_params import SamplingParams
from tests.multimodal_models import build_vlm, png_data_url, random_image

MAX_MODEL_LEN = 256


def input_processor(folder: str, max_model_len: int = MAX_MODEL_LEN, like: InputProcessor | None = None,
                    **flags) -> InputProcessor:
    """The frontend's input processor for the model in `folder` (with the tokenizer and model
    processor of `like`, loaded once)."""
    source = ModelSource(folder, "hf")
    tokenizer = load_tokenizer(source) if like is None else like.tokenizer
    return InputProcessor(tokenizer, source, EngineInfo("vlm", max_model_len, len(tokenizer)),
                          RequestLimits(max_prompt_chars=32 * max_model_len), multimodal=MultiModalConfig(**flags),
                          mm_processor=multimodal_processor(source) if like is None else like.mm_processor)


@pytest.fixture(scope="module", params=["llava", "qwen2_vl"])
def vlm(request, tmp_path_factory) -> str:
    return build_vlm(request.param, str(tmp_path_factory.mktemp(request.param)))


@pytest.fixture(scope="module")
def processor(vlm) -> InputProcessor:
    return input_processor(vlm)


def chat(*parts) -> list[dict]:
    return [{"role": "system", "content": "look"}, {"role": "user", "content": list(parts)}]


def text(value: str) -> dict:
    return {"type": "text", "text": value}


def image_url(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_a_chat_with_images_gives_the_processors_ids_and_features(processor):
    first, second = random_image(1), random_image(2, 60, 30)
    prompt = processor.apply_chat_template(chat(text("compare"), image_url(png_data_url(first)), text("with"),
                                                {"type": "image_pil", "image_pil": second}))
    rendered = processor.tokenizer.apply_chat_template(
        chat(text("compare"), {"type": "image"}, text("with"), {"type": "image"}), tokenize=False,
        add_generation_prompt=True)
    expected_ids, expected = processor.mm_processor.process(rendered, [first, second])
    assert isinstance(prompt, MultiModalPrompt) and prompt.token_ids == expected_ids
    request, _ = processor.process("r", prompt, SamplingParams(max_tokens=4))
    assert request.prompt_token_ids == expected_ids
    assert [(f.identifier, f.offset, f.length) for f in request.mm_features] == \
        [(f.identifier, f.offset, f.length) for f in expected]


def test_multi_modal_data_gives_the_processors_ids_and_features(processor):
    images = [random_image(3), random_image(4)]
    text_prompt = f"two: {processor.mm_processor.image_placeholder} and {processor.mm_processor.image_placeholder}"
    prompt = engine_prompt({"prompt": text_prompt, "multi_modal_data": {"image": images}}, processor)
    expected_ids, expected = processor.mm_processor.process(text_prompt, images)
    request, _ = processor.process("r", prompt, SamplingParams(max_tokens=4))
    assert request.prompt_token_ids == expected_ids
    assert [f.identifier for f in request.mm_features] == [f.identifier for f in expected]
    one = engine_prompt({"prompt": text_prompt.split(" and")[0], "multi_modal_data": {"image": images[0]}},
                        processor)
    assert one.features[0].identifier == expected[0].identifier
    with pytest.raises(InvalidRequestError, match="prompt holds 2 image placeholders .* for 1 images") as error:
        engine_prompt({"prompt": text_prompt, "multi_modal_data": {"image": images[0]}}, processor)
    assert error.value.param == "prompt"


def test_the_expanded_placeholders_count_against_max_model_len(vlm, processor):
    prompt = processor.apply_chat_template(chat(text("hi"), image_url(png_data_url(random_image(5)))))
    short = input_processor(vlm, max_model_len=len(prompt.token_ids), like=processor)  # the text alone would fit
    with pytest.raises(InvalidRequestError, match=f"prompt has {len(prompt.token_ids)} tokens, but max_model_len"):
        short.process("r", short.apply_chat_template(chat(text("hi"), image_url(png_data_url(random_image(5))))),
                      SamplingParams(max_tokens=1))


def test_more_images_than_the_limit_are_refused_before_any_is_loaded(vlm, processor):
    limited = input_processor(vlm, like=processor, limit_mm_per_prompt='{"image": 1}')
    broken = image_url("data:image/png;base64,AAAA")  # never decoded: the count is checked first
    with pytest.raises(InvalidRequestError, match=r"2 images, over the limit of 1 per prompt \(--limit-mm-per-prompt"
                       ) as error:
        limited.apply_chat_template(chat(image_url(png_data_url(random_image(6))), text("and"), broken))
    assert error.value.param == "messages[1].content[2]"


def test_a_broken_image_is_refused_naming_its_part(processor):
    with pytest.raises(InvalidRequestError, match="cannot be decoded") as error:
        processor.apply_chat_template(chat(text("see"), image_url("data:image/png;base64,AAAA")))
    assert error.value.param == "messages[1].content[1]"


def test_truncating_a_prompt_with_images_is_refused(processor):
    prompt = processor.apply_chat_template(chat(image_url(png_data_url(random_image(7)))))
    with pytest.raises(InvalidRequestError, match="truncate_prompt_tokens cannot be combined with images"):
        processor.process("r", prompt, SamplingParams(max_tokens=1, truncate_prompt_tokens=4))


def test_a_text_only_model_does_not_take_images():
    source = resolve_model(None)
    tokenizer = load_tokenizer(source)
    text_only = InputProcessor(tokenizer, source, EngineInfo("smollm2", 512, len(tokenizer)),
                               RequestLimits(max_prompt_chars=4096))
    with pytest.raises(InvalidRequestError, match="model 'smollm2' does not take images") as error:
        text_only.apply_chat_template(chat(text("see"), image_url(png_data_url(random_image(8)))))
    assert error.value.param == "messages[1].content[1]"
    with pytest.raises(InvalidRequestError, match="does not take images"):
        engine_prompt({"prompt": "see <image>", "multi_modal_data": {"image": random_image(8)}}, text_only)

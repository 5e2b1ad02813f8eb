"""MultiModalProcessor against transformers' processors: the same token ids, a placeholder
range per image where its tokens are, identifiers that follow the image's content."""

from __future__ import annotations

import numpy as np
import pytest

from chunkserve.config.model import ModelSource
from chunkserve.errors import InvalidRequestError
from chunkserve.model.loader import load_model_config
from chunkserve.model.vlm.processing import MultiModalProcessor
from tests.multimodal_models import random_image
from tests.multimodal_runner import vlm_folder


@pytest.fixture(scope="module", params=["llava", "idefics3", "qwen2_vl"])
def vlm(request, tmp_path_factory) -> tuple[str, str, MultiModalProcessor]:
    folder = vlm_folder(tmp_path_factory, request.param)
    return request.param, folder, MultiModalProcessor.from_folder(folder, load_model_config(ModelSource(folder, "hf")))


def _prompt(processor: MultiModalProcessor, num_images: int) -> str:
    return "<|im_start|>user\n" + f"{processor.image_placeholder} look".join([""] * (num_images + 1)) + "<|im_end|>\n"


def test_expansion_matches_transformers(vlm):
    architecture, folder, processor = vlm
    images = [random_image(1), random_image(2, 60, 30)]
    token_ids, features = processor.process(_prompt(processor, 2), images)
    image_token = processor.image_token_id
    assert [f.offset for f in features] == [i for i in range(len(token_ids))
                                            if token_ids[i] == image_token and token_ids[i - 1] != image_token]
    for feature in features:
        assert all(t == image_token for t in token_ids[feature.offset : feature.end])
        assert feature.num_embeds == feature.length <= processor.max_tokens_per_item()
    assert sum(f.length for f in features) == token_ids.count(image_token)
    if architecture != "qwen2_vl":  # its full processor needs torchvision
        from transformers import AutoProcessor

        expected = AutoProcessor.from_pretrained(folder)(text=_prompt(processor, 2), images=images,
                                                         return_tensors="np", add_special_tokens=False)
        assert token_ids == expected["input_ids"][0].tolist()
        np.testing.assert_array_equal(np.concatenate([f.data["pixel_values"] for f in features], axis=-4),
                                      expected["pixel_values"])
    else:
        grids = [f.data["image_grid_thw"][0] for f in features]
        assert [f.length for f in features] == [int(g.prod()) // 4 for g in grids]


def test_identifiers_follow_content(vlm):
    _, _, processor = vlm
    _, features = processor.process(_prompt(processor, 3), [random_image(5), random_image(6), random_image(5)])
    assert features[0].identifier == features[2].identifier != features[1].identifier


def test_placeholder_count_mismatch_is_a_400(vlm):
    _, _, processor = vlm
    with pytest.raises(InvalidRequestError) as error:
        processor.process(_prompt(processor, 2), [random_image(1)])
    assert error.value.param == "messages"


def test_marker_tokens_between_image_tokens_are_not_embeds(tmp_path_factory):
    """Idefics3 splitting an image into crops writes row/column markers among its image tokens."""
    folder = vlm_folder(tmp_path_factory, "idefics3")
    processor = MultiModalProcessor.from_folder(folder, load_model_config(ModelSource(folder, "hf")))
    processor.processor.image_processor.do_image_splitting = True
    processor.processor.image_processor.size = {"longest_edge": 64}
    token_ids, [feature] = processor.process(_prompt(processor, 1), [random_image(3, 64, 64)])
    from transformers import AutoProcessor

    expected = AutoProcessor.from_pretrained(folder)
    expected.image_processor.do_image_splitting, expected.image_processor.size = True, {"longest_edge": 64}
    reference = expected(text=_prompt(processor, 1), images=[random_image(3, 64, 64)], return_tensors="np",
                         add_special_tokens=False)["input_ids"][0]
    assert token_ids == reference.tolist()
    in_range = np.asarray(token_ids[feature.offset : feature.end])
    np.testing.assert_array_equal(feature.is_embed, in_range == processor.image_token_id)
    assert 0 < feature.num_embeds < feature.length
    assert feature.num_embeds == (reference == processor.image_token_id).sum() == 5 * 4  # 4 crops + global

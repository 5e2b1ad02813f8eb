"""Vision-language checkpoints load as their text decoder plus a MultiModalSpec; their tensors
are told apart under both namings transformers saved them with."""

from __future__ import annotations

import pytest

from chunkserve.config.model import ModelSource
from chunkserve.config.parallel import ParallelConfig
from chunkserve.errors import ModelLoadError
from chunkserve.model.loader import load_model_config
from chunkserve.model.vlm.checkpoint import text_weight_name, vision_weight_name
from tests.multimodal_runner import vlm_folder


@pytest.mark.parametrize("name, ours", [
    ("language_model.model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.up_proj.weight"),
    ("language_model.lm_head.weight", "lm_head.weight"),
    ("model.language_model.embed_tokens.weight", "model.embed_tokens.weight"),
    ("model.text_model.norm.weight", "model.norm.weight"),
    ("model.layers.1.self_attn.q_proj.bias", "model.layers.1.self_attn.q_proj.bias"),
    ("lm_head.weight", "lm_head.weight"),
    ("visual.blocks.0.attn.qkv.weight", None),
    ("model.visual.merger.mlp.0.bias", None),
    ("model.vision_model.post_layernorm.weight", None),
    ("multi_modal_projector.linear_1.weight", None),
])
def test_text_weights_under_either_naming(name, ours):
    assert text_weight_name(name) == ours


def test_vision_weights_under_either_naming():
    modules = {"visual"}
    assert vision_weight_name("visual.merger.mlp.0.bias", modules) == "visual.merger.mlp.0.bias"
    assert vision_weight_name("model.visual.merger.mlp.0.bias", modules) == "visual.merger.mlp.0.bias"
    assert vision_weight_name("model.layers.0.mlp.up_proj.weight", modules) is None


def test_qwen2_vl_config_is_its_text_decoder_with_m_rope(tmp_path_factory):
    config = load_model_config(ModelSource(vlm_folder(tmp_path_factory, "qwen2_vl"), "hf"))
    assert config.architecture == "Qwen2VLForConditionalGeneration" and config.qkv_bias
    assert (config.hidden_size, config.num_layers, config.head_dim) == (64, 2, 16)
    assert config.multimodal.mrope_section == (4, 2, 2) and config.multimodal.image_token_id == 49154
    with pytest.raises(ModelLoadError, match="one rank"):
        ParallelConfig(tensor_parallel_size=2).check_model(config)

"""The vision side of a vision-language model: transformers' own vision tower and projector
(the oracle's code, so their numerics are its numerics), fed one image at a time.

The transformers model is built on the meta device, its language model dropped (our LlamaModel
is the decoder), and only the vision tower's and projector's weights are materialized and read.
Each image is encoded whole (an atomic encoder input), to float32 rows of the text hidden size:
one per `is_embed` position of its feature. Qwen2-VL's M-RoPE positions come from the same
model's `get_rope_index`.
"""

from __future__ import annotations

import torch
from torch import nn

from chunkserve.core.multimodal import MultiModalFeature
from chunkserve.errors import ModelLoadError
from chunkserve.model.config import ModelConfig
from chunkserve.model.vlm.checkpoint import vision_weight_name

# the text decoder inside each base model, which the encoder drops
_LANGUAGE_MODELS = ("language_model", "text_model")


class VisionEncoder:
    def __init__(self, model: nn.Module, config: ModelConfig) -> None:
        """`model`: transformers' multimodal base model (LlavaModel, Idefics3Model, Qwen2VLModel)
        without its language model, its vision weights loaded."""
        self.model = model
        self.hidden_size = config.hidden_size
        self.uses_mrope = config.multimodal.mrope_section is not None
        hf_config = model.config
        # LLaVA's feature layer and CLS handling, as its forward passes them
        self.options = {key: getattr(hf_config, key) for key in ("vision_feature_layer", "vision_feature_select_strategy")
                        if hasattr(hf_config, key)}

    @classmethod
    def from_folder(cls, path: str, config: ModelConfig) -> VisionEncoder:
        """The vision tower and projector of the checkpoint in Hugging Face folder `path`, float32."""
        from transformers import AutoConfig, AutoModelForImageTextToText

        from chunkserve.model.loader import read_hf_weights

        hf_config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(hf_config, dtype=torch.float32).model
        for name in _LANGUAGE_MODELS:
            if getattr(model, name, None) is not None:
                setattr(model, name, None)
        model = model.to_empty(device="cpu")
        modules = {name for name, _ in model.named_children()}
        weights = read_hf_weights(path, lambda name: True, lambda name: vision_weight_name(name, modules))
        _load_vision_weights(model, weights, path)
        return cls(model.eval().requires_grad_(False), config)

    @torch.inference_mode()
    def encode(self, feature: MultiModalFeature) -> torch.Tensor:
        """The image's rows [feature.num_embeds, hidden] float32, in the order of its embed positions."""
        inputs = {key: torch.from_numpy(value) for key, value in feature.data.items()}
        output = self.model.get_image_features(**inputs, **self.options, return_dict=True)
        rows = output.pooler_output
        if len(rows) != 1:
            raise ValueError(f"the vision encoder returned {len(rows)} images' features for one image")
        rows = rows[0].reshape(-1, rows[0].shape[-1]).float()
        if rows.shape != (feature.num_embeds, self.hidden_size):
            raise ValueError(f"the vision encoder returned features {tuple(rows.shape)} for an image of "
                             f"{feature.num_embeds} embedding positions and hidden size {self.hidden_size}")
        return rows

    @torch.inference_mode()
    def mrope_positions(self, token_ids: list[int], features: list[MultiModalFeature]) -> tuple[torch.Tensor, int]:
        """M-RoPE: the prompt's positions [3, P] (an image's tokens at its t/h/w grid, text after it
        continuing from the image's largest) and the delta that every later position adds
        (position + delta on all three axes), by transformers' `get_rope_index`."""
        input_ids = torch.tensor([token_ids], dtype=torch.long)
        token_types = torch.zeros_like(input_ids, dtype=torch.int32)
        for feature in features:
            in_range = torch.ones(feature.length, dtype=torch.bool) if feature.is_embed is None else (
                torch.from_numpy(feature.is_embed))
            token_types[0, feature.offset : feature.end][in_range] = 1
        if not features:
            positions = torch.arange(len(token_ids)).expand(3, -1)
            return positions, 0
        grids = torch.cat([torch.from_numpy(f.data["image_grid_thw"]) for f in features])
        positions, deltas = self.model.get_rope_index(input_ids, token_types, image_grid_thw=grids)
        return positions[:, 0], int(deltas.reshape(-1)[0])


def _load_vision_weights(model: nn.Module, weights: dict[str, torch.Tensor], path: str) -> None:
    """Copy the checkpoint's vision tensors in, then let transformers initialize what a checkpoint
    does not hold (non-persistent buffers: position ids, rotary frequencies), as its own loading
    does, leaving the loaded tensors alone."""
    parameters = dict(model.named_parameters())
    missing = sorted(set(parameters) - set(weights))
    if missing:
        raise ModelLoadError(f"{path}: the vision weights {missing[:4]} ({len(missing)} in all) are missing")
    state = dict(model.state_dict(keep_vars=True))
    with torch.no_grad():
        for name, tensor in weights.items():
            if name in state:
                state[name].copy_(tensor)
                state[name]._is_hf_initialized = True
    model.initialize_weights()

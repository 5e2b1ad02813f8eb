"""A prompt with images -> token ids with each image expanded into its placeholder tokens, and
one `MultiModalFeature` per image, by transformers' processors (the oracle of the models'
expansion: how many tokens an image takes, and which marker tokens surround them).

The frontend runs this (no weights needed); the worker's encoder reads each feature's `data`.
Each image is preprocessed alone, so that its tensors, and with them its identifier, do not
depend on the other images of the prompt: the same image is the same encoder input anywhere.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from chunkserve.core.multimodal import MultiModalFeature
from chunkserve.errors import InvalidRequestError, ModelLoadError
from chunkserve.model.config import ModelConfig

if TYPE_CHECKING:
    from PIL.Image import Image

# the processor's outputs that describe the text, not the image
_TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


@dataclass
class _Expansion:
    """One image preprocessed: its tensors and the token ids its placeholder token becomes."""

    data: dict[str, np.ndarray]
    token_ids: list[int]


class MultiModalProcessor(ABC):
    """Per architecture, `_expand` turns one image into its tensors and tokens; the rest is shared."""

    image_placeholder: str  # what the chat template writes for one {"type": "image"} part, before expansion

    def __init__(self, tokenizer: Any, image_token_id: int, image_placeholder: str) -> None:
        self.tokenizer = tokenizer
        self.image_token_id = image_token_id  # the one token of the placeholder each image expands
        self.image_placeholder = image_placeholder

    @classmethod
    def from_folder(cls, path: str, config: ModelConfig) -> MultiModalProcessor:
        """The processor of the vision-language model in Hugging Face folder `path`."""
        if config.multimodal is None:
            raise ModelLoadError(f"{path} holds a text-only model ({config.architecture}): it takes no images")
        if config.multimodal.architecture == "Qwen2VLForConditionalGeneration":
            return _Qwen2VLProcessor.load(path, config.multimodal.image_token_id)
        return _HFProcessor.load(path, config.multimodal.image_token_id)

    def process(self, prompt: str, images: list[Image]) -> tuple[list[int], list[MultiModalFeature]]:
        """prompt: text holding one image_placeholder per image, in order (as the chat template
        renders it, special tokens included). Returns the prompt's token ids with every image
        expanded to its placeholder tokens, and one MultiModalFeature per image (its range runs
        from its first image token to its last; `is_embed` marks the image tokens where marker
        tokens sit between them)."""
        prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        slots = [index for index, token in enumerate(prompt_ids) if token == self.image_token_id]
        if len(slots) != len(images):
            raise InvalidRequestError(
                f"the prompt has {len(slots)} image placeholder(s) ({self.image_placeholder!r}) but the request has "
                f"{len(images)} image(s): each image part must be rendered by the chat template, and prompt text "
                "must not hold the placeholder itself", param="messages")
        token_ids: list[int] = []
        features: list[MultiModalFeature] = []
        previous = 0
        for slot, image in zip(slots, images):
            token_ids.extend(prompt_ids[previous:slot])
            expansion = self._expand(image)
            features.append(self._feature(expansion, len(token_ids)))
            token_ids.extend(expansion.token_ids)
            previous = slot + 1
        token_ids.extend(prompt_ids[previous:])
        return token_ids, features

    @abstractmethod
    def max_tokens_per_item(self) -> int:
        """The most placeholder tokens (a feature's length) one image may take."""

    @abstractmethod
    def _expand(self, image: Image) -> _Expansion:
        """The image's tensors and the tokens its placeholder token becomes."""

    def _feature(self, expansion: _Expansion, start: int) -> MultiModalFeature:
        is_image = np.asarray(expansion.token_ids) == self.image_token_id
        first, last = np.flatnonzero(is_image)[[0, -1]]
        is_embed = is_image[first : last + 1]
        return MultiModalFeature(identifier=content_hash(expansion.data), offset=start + int(first),
                                 length=len(is_embed), data=expansion.data,
                                 is_embed=None if is_embed.all() else is_embed)


def content_hash(data: dict[str, np.ndarray]) -> str:
    """Hex SHA-256 over an item's tensors (each one's name, dtype, shape and bytes, in key order):
    the same preprocessed image gives the same identifier, any other a different one."""
    digest = hashlib.sha256()
    for key in sorted(data):
        array = np.ascontiguousarray(data[key])
        digest.update(f"{key}:{array.dtype.str}:{array.shape};".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


class _HFProcessor(MultiModalProcessor):
    """LLaVA and Idefics3 / SmolVLM: transformers' full processor (`AutoProcessor`) expands the
    image token itself; run on the placeholder alone with one image, it gives that image's
    tokens and tensors."""

    def __init__(self, processor: Any, image_token_id: int) -> None:
        super().__init__(processor.tokenizer, image_token_id, processor.image_token)
        self.processor = processor

    @classmethod
    def load(cls, path: str, image_token_id: int) -> _HFProcessor:
        from transformers import AutoProcessor

        return cls(AutoProcessor.from_pretrained(path), image_token_id)

    def _expand(self, image: Image) -> _Expansion:
        out = self.processor(text=self.image_placeholder, images=[image], return_tensors="np",
                             add_special_tokens=False)
        data = {key: np.asarray(value) for key, value in out.items() if key not in _TEXT_KEYS}
        return _Expansion(data, [int(token) for token in out["input_ids"][0]])

    def max_tokens_per_item(self) -> int:
        """Measured on the largest image the image processor keeps (larger ones are resized to it):
        LLaVA's count is fixed, Idefics3's grows with the crops an image is split into."""
        from PIL import Image

        size = self.processor.image_processor.size
        side = size.get("longest_edge") or size.get("shortest_edge") or size.get("height")
        return self._feature(self._expand(Image.new("RGB", (side, side))), 0).length


class _Qwen2VLProcessor(MultiModalProcessor):
    """Qwen2-VL: transformers' Qwen2VLProcessor needs torchvision (for videos), so the image
    processor and the tokenizer separately; an image's `<|image_pad|>` becomes one token per
    merged patch, grid_thw.prod() // merge_size**2 of them, as that processor expands it."""

    def __init__(self, tokenizer: Any, image_processor: Any, image_token_id: int) -> None:
        placeholder = "<|vision_start|>" + tokenizer.convert_ids_to_tokens(image_token_id) + "<|vision_end|>"
        super().__init__(tokenizer, image_token_id, placeholder)
        self.image_processor = image_processor

    @classmethod
    def load(cls, path: str, image_token_id: int) -> _Qwen2VLProcessor:
        from transformers import AutoImageProcessor, AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path), AutoImageProcessor.from_pretrained(path), image_token_id)

    def _expand(self, image: Image) -> _Expansion:
        out = self.image_processor(images=[image], return_tensors="np")
        data = {key: np.asarray(value) for key, value in out.items()}
        num_tokens = int(data["image_grid_thw"].prod()) // self.image_processor.merge_size**2
        return _Expansion(data, [self.image_token_id] * num_tokens)

    def max_tokens_per_item(self) -> int:
        """The image processor resizes every image to at most `size["longest_edge"]` pixels (its max_pixels)."""
        processor = self.image_processor
        return processor.size["longest_edge"] // (processor.patch_size * processor.merge_size) ** 2

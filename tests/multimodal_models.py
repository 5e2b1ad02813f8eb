"""Tiny random-weight vision-language models built offline with transformers (the oracle), each
saved as a Hugging Face folder with its processor: LLaVA (CLIP tower, 1-D RoPE), Idefics3 /
SmolVLM (SigLIP tower, pixel shuffle) and Qwen2-VL (M-RoPE). The text side uses the default
model's tokenizer with the image tokens added; the chat template renders OpenAI-style content
lists ({"type": "image"} / {"type": "text"}) as the real models' templates do."""

from __future__ import annotations

import os

import numpy as np

ARCHITECTURES = ("llava", "idefics3", "qwen2_vl")

# Renders string content and content lists; each image part becomes the processor's image token.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}IMAGE_TOKEN{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer(*special: str):
    from chunkserve.config.model import resolve_model
    from chunkserve.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(None))
    tokenizer.add_special_tokens({"additional_special_tokens": list(special)})
    return tokenizer


def _text_config(config_class, tokenizer, **extra):
    return config_class(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=1024,
                        initializer_range=0.15, tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                        **extra)


def build_llava(folder: str, image_size: int = 32, patch_size: int = 8) -> str:
    """LLaVA: a CLIP tower (image_size / patch_size squared patches, one image token each), a
    two-layer projector, a Llama decoder."""
    import torch
    from transformers import (CLIPImageProcessor, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    tokenizer = _tokenizer("<image>")
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=image_size, patch_size=patch_size, projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=_text_config(LlamaConfig, tokenizer),
                         image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                         vision_feature_select_strategy="default", vision_feature_layer=-2)
    image_processor = CLIPImageProcessor(size={"shortest_edge": image_size},
                                         crop_size={"height": image_size, "width": image_size})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch_size,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=CHAT_TEMPLATE.replace("IMAGE_TOKEN", "<image>"))
    torch.manual_seed(0)
    return _save(LlavaForConditionalGeneration(config), processor, folder)


def build_idefics3(folder: str, image_size: int = 32) -> str:
    """Idefics3 / SmolVLM: a SigLIP tower, pixel shuffle (scale factor 2), a Llama decoder;
    one image (no splitting) is `<fake_token_around_image><global-img>` + image tokens +
    `<fake_token_around_image>`."""
    import torch
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor,
                              Idefics3Processor, Idefics3VisionConfig, LlamaConfig)

    tokenizer = _tokenizer("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>")
    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=image_size, patch_size=8)
    config = Idefics3Config(vision_config=vision, text_config=_text_config(LlamaConfig, tokenizer),
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), scale_factor=2)
    image_processor = Idefics3ImageProcessor(do_image_splitting=False, size={"longest_edge": image_size},
                                             max_image_size={"longest_edge": image_size})
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4,
                                  chat_template=CHAT_TEMPLATE.replace("IMAGE_TOKEN", "<image>"))
    torch.manual_seed(0)
    return _save(Idefics3ForConditionalGeneration(config), processor, folder)


def build_qwen2_vl(folder: str) -> str:
    """Qwen2-VL: a ViT over 14-pixel patches merged 2x2, a Qwen2 decoder with M-RoPE (sections
    4, 2, 2 of head_dim 16 / 2); an image's token count follows its size."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor

    tokenizer = _tokenizer("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=1024,
                initializer_range=0.15, tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]})
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, mlp_ratio=2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision,
                           image_token_id=tokenizer.convert_tokens_to_ids("<|image_pad|>"),
                           video_token_id=tokenizer.convert_tokens_to_ids("<|video_pad|>"),
                           vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
                           vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"))
    # transformers' Qwen2VLProcessor needs torchvision (for its video processor), which is not a dependency:
    # the folder holds the image processor and the tokenizer (with the chat template), as real ones do
    image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112)
    tokenizer.chat_template = CHAT_TEMPLATE.replace("IMAGE_TOKEN", "<|vision_start|><|image_pad|><|vision_end|>")
    torch.manual_seed(0)
    _save(Qwen2VLForConditionalGeneration(config), image_processor, folder)
    tokenizer.save_pretrained(folder)
    return folder


BUILDERS = {"llava": build_llava, "idefics3": build_idefics3, "qwen2_vl": build_qwen2_vl}


def build_vlm(architecture: str, folder: str) -> str:
    return BUILDERS[architecture](folder)


def _save(model, processor, folder: str) -> str:
    model.eval().save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def random_image(seed: int, width: int = 48, height: int = 40):
    """A PIL image of random pixels: the same seed gives the same image."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def png_data_url(image) -> str:
    """The image as an OpenAI `image_url` data URL."""
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def save_png(image, folder: str, name: str) -> str:
    path = os.path.join(folder, name)
    image.save(path, format="PNG")
    return path

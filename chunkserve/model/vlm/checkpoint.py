"""Which tensors of a vision-language checkpoint are the text decoder's, under the names our
LlamaModel reads (`model.layers.*`, `model.embed_tokens.*`, `model.norm.*`, `lm_head.*`).

transformers saved these models under two namings: the older (LLaVA's `language_model.model.*`
and `language_model.lm_head.*`, Qwen2-VL's `model.*` beside `visual.*`) and the current one
(`model.language_model.*`, Idefics3's `model.text_model.*`, `lm_head.*`); hub checkpoints come
in both."""

from __future__ import annotations

# checkpoint prefix -> our prefix, the first that matches wins
_TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.language_model.", "model."),
    ("model.text_model.", "model."),
    ("lm_head.", "lm_head."),
    ("model.", "model."),
)
_DECODER_PARTS = ("model.layers.", "model.embed_tokens.", "model.norm.", "lm_head.")


def text_weight_name(name: str) -> str | None:
    """The decoder's name for checkpoint tensor `name`; None for the vision tower's and projector's.
    'language_model.model.layers.0.mlp.up_proj.weight' -> 'model.layers.0.mlp.up_proj.weight';
    'model.visual.blocks.0.attn.qkv.weight' -> None."""
    for prefix, ours in _TEXT_PREFIXES:
        if name.startswith(prefix):
            renamed = ours + name[len(prefix):]
            return renamed if renamed.startswith(_DECODER_PARTS) else None
    return None


def vision_weight_name(name: str, modules: set[str]) -> str | None:
    """The name of checkpoint tensor `name` inside transformers' multimodal base model (LlavaModel,
    Idefics3Model, Qwen2VLModel) where it belongs to one of its submodules `modules` (the vision
    tower and the projector); None otherwise. 'visual.merger.mlp.0.bias' and
    'model.visual.merger.mlp.0.bias' -> 'visual.merger.mlp.0.bias'."""
    bare = name.removeprefix("model.")
    return bare if bare.split(".", 1)[0] in modules else None

"""The model's shape, read from a transformers config, plus the rotary tables."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from chunkserve.errors import ModelLoadError

TEXT_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# vision-language checkpoints -> the text decoder inside them, which our LlamaModel runs. SmolVLM's first
# checkpoints are Idefics3's; its own class (SmolVLM2) is not here: transformers' SmolVLMProcessor needs a
# video processor, which needs torchvision
MULTIMODAL_ARCHITECTURES = {"LlavaForConditionalGeneration": "LlamaForCausalLM",
                            "Idefics3ForConditionalGeneration": "LlamaForCausalLM",
                            "Qwen2VLForConditionalGeneration": "Qwen2ForCausalLM"}
SUPPORTED_ARCHITECTURES = TEXT_ARCHITECTURES + tuple(MULTIMODAL_ARCHITECTURES)
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class MultiModalSpec:
    """What the engine must know of a vision-language model beyond its text decoder."""

    architecture: str  # the checkpoint's, e.g. "LlavaForConditionalGeneration"
    image_token_id: int  # the placeholder token an image's encoder rows replace
    mrope_section: tuple[int, ...] | None  # Qwen2-VL's M-RoPE: rotary frequencies per t/h/w; None: 1-D RoPE


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2, or Llama with attention_bias
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before the rotary embedding
    sliding_window: int | None
    hf_config: Any  # the transformers config, for the rotary parameters
    # divisors of the rotary inverse frequencies [head_dim // 2]: how llama.cpp stores Llama 3's rope scaling
    rope_freq_factors: tuple[float, ...] | None = None
    multimodal: MultiModalSpec | None = None  # None: a text-only model

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> ModelConfig:
        architectures = getattr(hf_config, "architectures", None) or []
        architecture = architectures[0] if architectures else _architecture_from_model_type(hf_config)
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"architecture {architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if architecture in MULTIMODAL_ARCHITECTURES:
            return _multimodal_config(architecture, hf_config)
        return cls._text_config(architecture, hf_config)

    @classmethod
    def _text_config(cls, architecture: str, hf_config: Any) -> ModelConfig:
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        sliding_window = getattr(hf_config, "sliding_window", None)
        if architecture.startswith("Qwen") and not getattr(hf_config, "use_sliding_window", False):
            sliding_window = None
        return cls(
            architecture=architecture,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            max_position_embeddings=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=architecture == "Qwen2ForCausalLM" or bool(getattr(hf_config, "attention_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            sliding_window=sliding_window,
            hf_config=hf_config,
        )

    def rotary_inv_freq(self) -> tuple[torch.Tensor, float]:
        """Inverse frequencies `[head_dim // 2]` and the attention scaling of the rope type."""
        inv_freq, scaling = self._rope_type_inv_freq()
        if self.rope_freq_factors is not None:
            inv_freq = inv_freq / torch.tensor(self.rope_freq_factors, device="cpu")
        return inv_freq, scaling

    def _rope_type_inv_freq(self) -> tuple[torch.Tensor, float]:
        params = getattr(self.hf_config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type not in _STATIC_ROPE_TYPES:
            raise ModelLoadError(f"rope type {rope_type!r} is not supported; supported: {', '.join(_STATIC_ROPE_TYPES)}")
        if rope_type == "default":
            theta = params.get("rope_theta", 10000.0)
            exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device="cpu").float() / self.head_dim
            return 1.0 / (theta**exponents), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        with torch.device("cpu"):  # even when the model is being built on the meta device
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](self.hf_config, torch.device("cpu"))
        return inv_freq.float(), float(scaling)


def _multimodal_config(architecture: str, hf_config: Any) -> ModelConfig:
    """The text decoder's shape from the text config, under the checkpoint's architecture."""
    text_config = hf_config.get_text_config()
    mrope_section = (getattr(text_config, "rope_parameters", None) or {}).get("mrope_section")
    spec = MultiModalSpec(architecture=architecture, image_token_id=int(hf_config.image_token_id),
                          mrope_section=None if mrope_section is None else tuple(mrope_section))
    decoder = ModelConfig._text_config(MULTIMODAL_ARCHITECTURES[architecture], text_config)
    return dataclasses.replace(decoder, architecture=architecture, multimodal=spec)


def _architecture_from_model_type(hf_config: Any) -> str:
    model_type = getattr(hf_config, "model_type", None)
    by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}
    if model_type not in by_type:
        raise ModelLoadError(
            f"model type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return by_type[model_type]

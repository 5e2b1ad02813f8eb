"""Find a model, read its config and weights: a Hugging Face folder or a GGUF file.

GGUF weights are dequantized to float at load; the linear layers stored as Q4_0, Q4_1 or
Q8_0 blocks also keep those blocks, which the C++ linear reads at decode batch sizes.
llama.cpp's converter permutes the rows of Llama's Q and K weights (to interleave the rotary
halves); we undo it, on the floats and on the blocks alike, so one model code serves both
formats.

Split over ranks, each rank builds only its part (`LlamaModel.uses_weight`): the other
stages' tensors are not read (nor dequantized), and its shards are sliced from the rest.
"""

from __future__ import annotations

import functools
import glob
import json
import os
from collections.abc import Callable

import numpy as np
import torch

from chunkserve.config.model import ModelSource
from chunkserve.errors import ModelLoadError
from chunkserve.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from chunkserve.model.llama import LlamaModel
from chunkserve.model.parallel import ParallelContext
from chunkserve.ops.model_ops import BLOCK_TYPES, BlockWeight

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # EngineArgs.dtype -> torch


def load_model_config(source: ModelSource) -> ModelConfig:
    if source.kind == "hf":
        with open(os.path.join(source.path, "config.json")) as f:
            raw = json.load(f)
        architectures = raw.get("architectures") or []
        if architectures and architectures[0] not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"architecture {architectures[0]!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        from transformers import AutoConfig

        return ModelConfig.from_hf_config(AutoConfig.from_pretrained(source.path))
    return ModelConfig.from_hf_config(_gguf_hf_config(gguf_reader(source.path)))


def load_model(source: ModelSource, config: ModelConfig, dtype: str, max_positions: int,
               parallel: ParallelContext | None = None) -> LlamaModel:
    """Build this rank's part of the model (all of it unless `parallel` splits it) with empty
    weights, then fill them from the checkpoint, reading only the tensors it uses."""
    with torch.device("meta"):
        model = LlamaModel(config, max_positions, parallel)
    model = model.to_empty(device="cpu").to(TORCH_DTYPES[dtype])
    if source.kind == "hf":
        weights, blocks = _read_hf_weights(source.path, model.uses_weight), {}
    else:
        weights, blocks = _read_gguf_weights(source.path, config, model.uses_weight)
    with torch.no_grad():
        model.load_hf_weights(weights, blocks)
    return model.eval()


def _read_hf_weights(folder: str, wanted: Callable[[str], bool]) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    weights: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, framework="pt") as file:
            weights.update((name, file.get_tensor(name)) for name in file.keys() if wanted(name))
    return weights


# ----- GGUF ---------------------------------------------------------------------------

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


@functools.lru_cache(maxsize=1)
def gguf_reader(path: str):
    """Cached: the config, the weights and the tokenizer all read the same file."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported; supported GGUF architectures: llama")
    return reader


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _gguf_hf_config(reader):
    from transformers import LlamaConfig

    def arch_field(key: str, default=None):
        return _field(reader, f"llama.{key}", default)

    num_heads = arch_field("attention.head_count")
    hidden = arch_field("embedding_length")
    rope_parameters = {"rope_type": "default", "rope_theta": float(arch_field("rope.freq_base", 10000.0))}
    if arch_field("rope.scaling.type") == "linear":
        rope_parameters.update(rope_type="linear", factor=float(arch_field("rope.scaling.factor")))
    tensor_names = {t.name for t in reader.tensors}
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=arch_field("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=hidden,
        intermediate_size=arch_field("feed_forward_length"),
        num_hidden_layers=arch_field("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=arch_field("attention.head_count_kv", num_heads),
        head_dim=arch_field("rope.dimension_count", hidden // num_heads),
        rms_norm_eps=float(arch_field("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=arch_field("context_length"),
        rope_parameters=rope_parameters,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
    )


def _read_gguf_weights(path: str, config: ModelConfig, wanted: Callable[[str], bool]
                       ) -> tuple[dict[str, torch.Tensor], dict[str, BlockWeight]]:
    """The float weights under Hugging Face names, and the blocks of those stored in
    BLOCK_TYPES; only the `wanted` ones are dequantized."""
    import gguf

    reader = gguf_reader(path)
    weights, blocks = {}, {}
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if not wanted(name):
            continue
        heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}.get(name.split(".")[-2])

        def rows_in_hf_order(array: np.ndarray) -> np.ndarray:  # a copy: GGUF tensors are read-only maps
            return np.array(array if heads is None else _unpermute_rotary_rows(array, heads))

        floats = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        weights[name] = torch.from_numpy(rows_in_hf_order(floats).astype(np.float32, copy=False))
        if tensor.tensor_type.name in BLOCK_TYPES:  # tensor.data: uint8 [rows, bytes per row]
            blocks[name] = BlockWeight(int(tensor.tensor_type), torch.from_numpy(rows_in_hf_order(tensor.data)))
    return weights, blocks


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[gguf_name]
    _, layer, module, suffix = gguf_name.split(".")
    if module not in _GGUF_LAYER_NAMES:
        raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{layer}.{_GGUF_LAYER_NAMES[module]}.{suffix}"


def _unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `reshape(heads, 2, half, ...).swapaxes(1, 2)` on Q/K rows."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)

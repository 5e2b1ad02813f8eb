"""GGUF files written from a Hugging Face folder as llama.cpp's converter (convert_hf_to_gguf.py)
writes them: its metadata keys and tensor names, Llama's q/k row permutation, and Llama 3's
rope scaling as a `rope_freqs` tensor. An independent writer, so that the loader's reading of
llama.cpp's conventions is checked against transformers on the folder's own weights."""

from __future__ import annotations

import os

import gguf
import numpy as np
import torch

GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
LAYER_NAMES = {  # the module in a layer -> llama.cpp's tensor in blk.N
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def write_gguf(hf_folder: str, path: str, matrix_type: str = "F32", tokenizer_from: str | None = None,
               with_lm_head: bool = True) -> str:
    """`path`: the folder's model as a GGUF with its matrices in `matrix_type` (F32 or a
    gguf.GGMLQuantizationType name; norms and biases stay F32), the tokenizer metadata of the
    GGUF `tokenizer_from` if given, and without output.weight unless `with_lm_head` (a tied
    head, reading the embedding)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_folder)
    arch = config.model_type
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(path, arch)
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if tokenizer_from is not None:
        _copy_tokenizer(gguf.GGUFReader(tokenizer_from), writer)
    if config.rope_parameters["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_freqs(config, head_dim))
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for name, tensor in load_file(os.path.join(hf_folder, "model.safetensors")).items():
        module, suffix = name.rsplit(".", 1)
        if module == "lm_head" and not with_lm_head:
            continue
        if module in GLOBAL_NAMES:
            gguf_module = GLOBAL_NAMES[module]
        else:
            _, _, layer, rest = module.split(".", 3)
            gguf_module = f"blk.{layer}.{LAYER_NAMES[rest]}"
        array = tensor.numpy()
        if arch == "llama" and gguf_module.split(".")[-1] in heads:
            array = _llama_cpp_permute(array, heads[gguf_module.split(".")[-1]])
        if array.ndim == 2 and matrix_type != "F32":
            ggml_type = gguf.GGMLQuantizationType[matrix_type]
            writer.add_tensor(f"{gguf_module}.{suffix}", gguf.quants.quantize(array, ggml_type), raw_dtype=ggml_type)
        else:
            writer.add_tensor(f"{gguf_module}.{suffix}", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rotary halves interleaved."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _llama3_rope_freqs(config, head_dim: int) -> np.ndarray:
    """What llama.cpp stores for Llama 3's rope: per frequency, the divisor taking the
    default inverse frequency to Llama 3's."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    llama3, _ = ROPE_INIT_FUNCTIONS["llama3"](config, torch.device("cpu"))
    default = 1.0 / config.rope_parameters["rope_theta"] ** (torch.arange(0, head_dim, 2).float() / head_dim)
    return (default / llama3).numpy().astype(np.float32)


def _copy_tokenizer(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            array = field.types[0] == gguf.GGUFValueType.ARRAY
            writer.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1] if array else None)

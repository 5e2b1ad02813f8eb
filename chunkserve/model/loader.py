"""Find a model, read its config and weights: a Hugging Face folder or a GGUF file.

GGUF (Llama, Mistral, Qwen2, Qwen3) weights are dequantized to float at load; the linear
layers stored as Q4_0, Q4_1 or Q8_0 blocks also keep those blocks, which the C++ linear reads
at decode batch sizes. llama.cpp's converter renames the tensors and permutes the rows of
Llama's Q and K weights (to interleave the rotary halves); transformers' GGUF tables undo
both, which we apply to the floats and to the blocks alike, so one model code serves both
formats.

Split over ranks, each rank builds only its part (`LlamaModel.uses_weight`): the other
stages' tensors are not read (nor dequantized), and its shards are sliced from the rest.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import os
from collections.abc import Callable

import numpy as np
import torch

from chunkserve.config.model import ModelSource
from chunkserve.errors import InvalidRequestError, ModelLoadError
from chunkserve.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from chunkserve.model.llama import LlamaModel
from chunkserve.model.parallel import ParallelContext
from chunkserve.model.vlm.checkpoint import text_weight_name
from chunkserve.ops.cpu_features import require_int8_dot, require_native_bf16
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
    return _gguf_model_config(source.path)


def load_model(source: ModelSource, config: ModelConfig, dtype: str, max_positions: int,
               parallel: ParallelContext | None = None, int8_activations: bool = False) -> LlamaModel:
    """Build this rank's part of the model (all of it unless `parallel` splits it) with empty
    weights, then fill them from the checkpoint, reading only the tensors it uses. The weights
    are float32 in every mode: `dtype` bfloat16 is the KV cache's and the linear layers'
    (`LlamaModel.compute_dtype`), whose weights the ops pack in bfloat16 (`set_ops`); it is
    refused on a CPU without native bfloat16. `int8_activations` (`LlamaModel.int8_activations`)
    is refused on a CPU without VNNI and for a model without GGUF block weights."""
    if dtype == "bfloat16":
        require_native_bf16()
    if int8_activations:
        require_int8_dot()
    with torch.device("meta"):
        model = LlamaModel(config, max_positions, parallel)
    model = model.to_empty(device="cpu")
    model.compute_dtype = TORCH_DTYPES[dtype]
    if source.kind == "hf":
        rename = text_weight_name if config.multimodal is not None else None
        weights, blocks = read_hf_weights(source.path, model.uses_weight, rename), {}
    else:
        weights, blocks = _read_gguf_weights(source.path, config, model.uses_weight)
    with torch.no_grad():
        model.load_hf_weights(weights, blocks)
    if int8_activations and not model.has_block_weights():
        raise InvalidRequestError(
            f"--int8-activations applies to GGUF weights in Q4_0, Q4_1 or Q8_0 blocks; {source.path} has none "
            "(a Hugging Face folder, or another GGUF type): leave the flag off", param="int8_activations")
    model.int8_activations = int8_activations
    return model.eval()


def _progress(items, description: str, unit: str):
    """A progress bar on a terminal (a large model takes minutes to load); nothing in a log file."""
    from tqdm import tqdm

    return tqdm(items, desc=description, unit=unit, disable=None, leave=False)


def read_hf_weights(folder: str, wanted: Callable[[str], bool],
                    rename: Callable[[str], str | None] | None = None) -> dict[str, torch.Tensor]:
    """The `wanted` tensors of a folder's safetensors shards, each under `rename(name)` where
    given (None: not read)."""
    from safetensors import safe_open

    weights: dict[str, torch.Tensor] = {}
    paths = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    for path in _progress(paths, "Loading safetensors shards", "shard"):
        with safe_open(path, framework="pt") as file:
            for name in file.keys():
                ours = name if rename is None else rename(name)
                if ours is not None and wanted(ours):
                    weights[ours] = file.get_tensor(name)
    return weights


# ----- GGUF ---------------------------------------------------------------------------
# llama.cpp's metadata keys, tensor names and value transforms are for transformers (and the
# gguf package, whose name map it uses) to keep up with: we take its config key mapping, its
# names and its per-tensor processors (the Llama q/k row permutation), applied to our one
# reading of the file, tensor by tensor. Its `load_gguf_checkpoint` would parse the file again
# and, with tensors, dequantize all of them at once.

# `general.architecture` of the files we serve; llama.cpp writes Mistral's as "llama".
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# Llama 3's rope scaling, which llama.cpp stores as a tensor of per-frequency divisors.
_ROPE_FREQS = "rope_freqs.weight"


@functools.lru_cache(maxsize=4)
def gguf_reader(path: str):
    """Cached: the config, the weights and the fingerprint all read the same file (and a test
    session alternates between a few models)."""
    reader = _fast_gguf_reader()(path)
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported; supported GGUF architectures: "
                             f"{', '.join(GGUF_ARCHITECTURES)} (Mistral's files are llama)")
    return reader


@functools.cache
def _fast_gguf_reader() -> type:
    """gguf's GGUFReader, reading its values from a plain ndarray view of the file's memory map
    instead of the np.memmap itself. The reader makes one array per value it parses, about
    200,000 for a tokenizer's vocabulary and merges, and each slice of a memmap runs memmap's
    Python-level __array_finalize__: that was 3/4 of the time to open a GGUF, twice per server
    start (the frontend and the engine core). The arrays are the same values and dtypes over
    the same mapping (tests/model/test_gguf.py compares the two readers)."""
    import gguf

    class MappedGGUFReader(gguf.GGUFReader):
        def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
            dtype = _numpy_dtype(dtype)
            count = int(count)
            array = plain[offset:offset + dtype.itemsize * count].view(dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return array if order == "I" else array.view(array.dtype.newbyteorder(order))

    return MappedGGUFReader


@functools.cache
def _numpy_dtype(dtype) -> np.dtype:
    return np.dtype(dtype)


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _gguf_model_config(path: str) -> ModelConfig:
    """transformers' config of the file, by its GGUF key mapping, plus what that mapping leaves
    out: the head size, which llama.cpp writes as `attention.key_length` (transformers takes it
    from the rotary dimension for llama only, and gives Qwen3 its class default of 128), a
    linear rope scaling, and Llama 3's rope frequency factors."""
    from transformers import AutoConfig
    from transformers.integrations import GGUF_CONFIG_MAPPING

    reader = gguf_reader(path)
    arch = _field(reader, "general.architecture")
    hf_config = {hf_key: _field(reader, f"{arch}.{key}") for key, hf_key in GGUF_CONFIG_MAPPING[arch].items()
                 if hf_key is not None and f"{arch}.{key}" in reader.fields}
    if "vocab_size" not in hf_config:  # files from older converters: the tokenizer's
        hf_config["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    # llama.cpp writes the output projection only where it is not the embedding matrix
    hf_config["tie_word_embeddings"] = all(tensor.name != "output.weight" for tensor in reader.tensors)
    if (head_dim := _field(reader, f"{arch}.attention.key_length")) is not None:
        hf_config["head_dim"] = head_dim
    # llama.cpp's default base where the file states none, not the config class's
    rope_parameters = {"rope_type": "default", "rope_theta": float(hf_config.pop("rope_theta", 10000.0))}
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        rope_parameters.update(rope_type="linear", factor=float(_field(reader, f"{arch}.rope.scaling.factor")))
    elif scaling != "none":
        raise ModelLoadError(f"GGUF rope scaling {scaling!r} is not supported; supported: linear, and Llama 3's "
                             f"{_ROPE_FREQS!r}")
    config = ModelConfig.from_hf_config(AutoConfig.for_model(arch, rope_parameters=rope_parameters, **hf_config))
    factors = next((tensor for tensor in reader.tensors if tensor.name == _ROPE_FREQS), None)
    if factors is None:
        return config
    return dataclasses.replace(config, rope_freq_factors=tuple(float(f) for f in factors.data))


def _read_gguf_weights(path: str, config: ModelConfig, wanted: Callable[[str], bool]
                       ) -> tuple[dict[str, torch.Tensor], dict[str, BlockWeight]]:
    """The float weights under Hugging Face names, and the blocks of those stored in
    BLOCK_TYPES; only the `wanted` ones are dequantized."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    reader = gguf_reader(path)
    arch = _field(reader, "general.architecture")
    hf_names = _gguf_hf_names(config, arch)
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(
        config={"num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads})
    weights, blocks = {}, {}
    for tensor in _progress(reader.tensors, "Loading GGUF tensors", "tensor"):
        if tensor.name == _ROPE_FREQS:  # read into the config
            continue
        if tensor.name not in hf_names:
            raise ModelLoadError(f"GGUF tensor {tensor.name!r} has no place in a {config.architecture}")
        name = hf_names[tensor.name]
        if not wanted(name):
            continue

        def rows_in_hf_order(array: np.ndarray) -> np.ndarray:  # a copy: GGUF tensors are read-only maps
            return np.array(processor.process(weights=array, name=tensor.name).weights)

        floats = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        weights[name] = torch.from_numpy(rows_in_hf_order(floats).astype(np.float32, copy=False))
        if tensor.tensor_type.name in BLOCK_TYPES:  # tensor.data: uint8 [rows, bytes per row]
            blocks[name] = BlockWeight(int(tensor.tensor_type), torch.from_numpy(rows_in_hf_order(tensor.data)))
    return weights, blocks


def _gguf_hf_names(config: ModelConfig, arch: str) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, as transformers' `get_gguf_hf_weights_map` maps
    them: the gguf package's name map over the parameter names of the transformers model,
    built on the meta device (no memory, no weights). Not that function itself, which rebuilds
    the name map for every submodule: seconds of start-up (measured: docs/benchmarks-log.md,
    "Costs behind choices in the code")."""
    import gguf
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config.hf_config)
    arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    name_map = gguf.get_tensor_name_map(arch_id, config.num_layers)
    names = {}
    for hf_name in skeleton.state_dict():
        module, suffix = hf_name.rsplit(".", 1)
        if (gguf_module := name_map.get_name(module)) is not None:
            names[f"{gguf_module}.{suffix}"] = hf_name
    return names

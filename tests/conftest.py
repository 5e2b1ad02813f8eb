"""Shared fixtures: tiny random-weight models of each architecture (built with transformers,
nothing downloaded) and the default SmolLM2 model with transformers' own load of it."""

from __future__ import annotations

import copy
import os
import shutil

import pytest
import torch

from chunkserve.config.model import default_model_path, resolve_model
from chunkserve.engine.tokenizer import load_tokenizer

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15)


def tiny_hf_config(arch: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if arch == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        return LlamaConfig(**TINY, rope_parameters=rope, tie_word_embeddings=False)
    if arch == "qwen2":
        return Qwen2Config(**TINY, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True)
    if arch == "qwen3":
        return Qwen3Config(**TINY, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                           tie_word_embeddings=False)
    raise ValueError(arch)


@pytest.fixture(scope="session", autouse=True)
def load_each_model_once():
    """Engines built in this test process share each model's weights: the first engine of a
    (model, dtype) loads them, later ones get a copy of the module tree over the same tensors
    (their own ops and packed weights, which the runner sets, and their own rotary tables, the
    only part that depends on the length). One copy per length would hold a gigabyte more for
    every few tests, more than CI's memory beside the servers of the HTTP tests."""
    from chunkserve.model import loader
    from chunkserve.model.llama import RotaryEmbedding
    from chunkserve.worker import worker

    loaded: dict[tuple, torch.nn.Module] = {}

    def load_model(source, config, dtype, max_positions, parallel=None, int8_activations=False):
        if parallel is not None and parallel.tp_size * parallel.pp_size > 1:  # a shard: not shared
            return loader.load_model(source, config, dtype, max_positions, parallel, int8_activations)
        key = (source.path, dtype, int8_activations)
        if key not in loaded:
            loaded[key] = loader.load_model(source, config, dtype, max_positions, int8_activations=int8_activations)
        model = _sharing_weights(loaded[key])
        model.rotary = RotaryEmbedding(config, max_positions)
        return model

    patch = pytest.MonkeyPatch()
    patch.setattr(worker, "load_model", load_model)
    yield
    patch.undo()


def _sharing_weights(module: torch.nn.Module) -> torch.nn.Module:
    clone = copy.copy(module)  # a new __dict__ over the same values
    clone._modules = {name: _sharing_weights(child) for name, child in module._modules.items()}
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    return clone


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> str:
    """The behaviour tier's model (tests/tiny_model.py): a random Llama GGUF with SmolLM2's
    tokenizer and chat template, built once per session."""
    from tests.tiny_model import build_tiny_gguf

    return build_tiny_gguf(str(tmp_path_factory.mktemp("tiny-gguf")))


@pytest.fixture(scope="session")
def default_tokenizer():
    return load_tokenizer(resolve_model(None))


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3"])
def tiny_model_dir(request, tmp_path_factory, default_tokenizer):
    """A Hugging Face folder with random weights, the default tokenizer and its vocabulary."""
    from transformers import AutoModelForCausalLM

    config = tiny_hf_config(request.param)
    config.vocab_size = len(default_tokenizer)
    config.eos_token_id = default_tokenizer.eos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    model.save_pretrained(folder)
    default_tokenizer.save_pretrained(folder)
    return str(folder)


def has_cxx_compiler() -> bool:
    return shutil.which(os.environ.get("CXX", "c++")) is not None


@pytest.fixture(scope="session")
def cpp_ops():
    """The worker's C++ ops. Wherever a C++ compiler exists they must build (a failed build
    fails the test); only a machine with no compiler at all skips, and there the engine serves
    with plain torch, whose fallback tests/ops/test_cpp_ops.py checks."""
    if not has_cxx_compiler():
        pytest.skip("no C++ compiler on this machine; the engine falls back to plain torch")
    from chunkserve.ops.cpp_ops import build_cpp_ops

    return build_cpp_ops()


@pytest.fixture(params=["avx512", "avx2"])
def cpu_isa(request, cpp_ops):
    """Each instruction set the kernels with several variants can run with here: the AVX-512
    kernels run only on a CPU that has them, the AVX2 path is kept for those that do not (and
    checked here too, where the CPU has both)."""
    try:
        before = cpp_ops.set_cpu_isa(request.param)
    except RuntimeError as error:
        pytest.skip(f"not on this CPU: {error}")
    yield request.param
    cpp_ops.set_cpu_isa(before)


@pytest.fixture(scope="session")
def hf_default_model():
    """transformers' own load of the default GGUF: the oracle for our loader and engine."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def default_llm():
    """One engine on the default model with a mid-sized budget, shared by engine tests."""
    from chunkserve import LLM

    return LLM(dtype="float32", max_num_batched_tokens=64, kv_cache_memory_gb=0.25, max_num_seqs=32)


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """The real server (subprocess) with a mid-sized budget, shared by HTTP tests."""
    from tests.server_process import start_server, stop_server

    trace_path = str(tmp_path_factory.mktemp("trace") / "steps.jsonl")
    started = start_server(tmp_path_factory, "--max-num-batched-tokens", "64", "--max-num-seqs", "32",
                           "--trace-steps", trace_path, name="server")
    started.trace_path = trace_path
    yield started
    stop_server(started)


@pytest.fixture(scope="session")
def tiny_delayed_server(tmp_path_factory, tiny_gguf):
    """One tiny-model server for the API, hostile-input and bench tests (a start costs more than
    their calls), with the session server's budget. Each step sleeps STEP_DELAY_MS, so a test that
    acts while a request prefills or decodes finds it there; it writes --trace-steps."""
    from chunkserve.engine.core import TEST_STEP_DELAY_ENV
    from tests.entrypoints.server.tiny_server_support import start_tiny_server
    from tests.server_process import stop_server
    from tests.tiny_model import STEP_DELAY_MS

    started = start_tiny_server(tmp_path_factory, tiny_gguf, name="tiny-delayed", trace_steps=True,
                                env={TEST_STEP_DELAY_ENV: str(STEP_DELAY_MS)})
    yield started
    stop_server(started)

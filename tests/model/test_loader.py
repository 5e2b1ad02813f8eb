"""Loading: the embedded GGUF gives transformers' logits; bad paths and architectures are
clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from chunkserve.config.model import resolve_model
from chunkserve.errors import InvalidRequestError, ModelLoadError
from chunkserve.model.loader import load_model, load_model_config
from tests.paged_runner import PagedRunner, reference_logits


@pytest.fixture(scope="module")
def default_gguf():
    source = resolve_model(None)
    assert source.kind == "gguf"
    config = load_model_config(source)
    return load_model(source, config, "float32", 1024), config


def test_default_gguf_logits_match_transformers_load(default_gguf, hf_default_model):
    model, config = default_gguf
    assert (config.architecture, config.num_layers, config.num_kv_heads, config.tie_word_embeddings) == (
        "LlamaForCausalLM", 30, 3, True)
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, 100).tolist()
    runner = PagedRunner(model, config)
    runner.add("a", prompt)
    got = torch.cat([runner.step({"a": 48})["a"], runner.step({"a": 52})["a"]])
    torch.testing.assert_close(got, reference_logits(hf_default_model, prompt), atol=1e-4, rtol=1e-4)


def test_default_gguf_keeps_the_blocks_of_its_quantized_linears(default_gguf):
    """Q4_1 layers and the Q8_0 tied LM head keep their blocks, rows in the float weight's
    order (the rotary un-permutation and the q/k/v and gate/up fusion applied to them too)."""
    import gguf

    model, config = default_gguf
    layer = model.layers[config.num_layers - 1]
    linears = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    for linear, expected_type in [(linear, "Q4_1") for linear in linears] + [(model, "Q8_0")]:
        blocks = linear.embedding_blocks if linear is model else linear.blocks
        weight = model.embed_tokens.weight if linear is model else linear.weight
        assert blocks.ggml_type == gguf.GGMLQuantizationType[expected_type]
        dequantized = gguf.quants.dequantize(blocks.blocks.numpy(), blocks.ggml_type)
        assert torch.equal(torch.from_numpy(dequantized), weight)


def test_default_gguf_decodes_from_its_blocks_with_transformers_logits(default_gguf, hf_default_model, cpp_ops):
    """Decode steps (one row: under SMALL_BATCH_MAX_ROWS) run the C++ linear on the Q4_1 blocks
    and the LM head on the Q8_0 blocks; the logits stay transformers' own."""
    model, config = default_gguf
    prompt = np.random.default_rng(1).integers(0, config.vocab_size, 40).tolist()
    runner = PagedRunner(model, config, cpp_ops=cpp_ops)
    runner.add("a", prompt)
    got = [runner.step({"a": 30})["a"]] + [runner.step({"a": 1})["a"] for _ in range(10)]
    torch.testing.assert_close(torch.cat(got), reference_logits(hf_default_model, prompt), atol=1e-4, rtol=1e-4)


def test_bfloat16_keeps_float32_parameters_and_is_close(tiny_model_dir):
    """bfloat16 mode: the parameters (embeddings, norms, the head) stay float32; the linear layers
    compute from bfloat16 copies of their weights, which replace the float32 ones, and the KV
    cache is bfloat16 (plain torch here; the C++ ops' contract is tests/ops/test_bf16.py)."""
    source = resolve_model(tiny_model_dir)
    config = load_model_config(source)
    fp32, bf16 = load_model(source, config, "float32", 256), load_model(source, config, "bfloat16", 256)
    assert bf16.embed_tokens.weight.dtype == torch.float32 and bf16.compute_dtype == torch.bfloat16
    prompt = list(range(100, 140))
    logits = []
    for model in (fp32, bf16):
        runner = PagedRunner(model, config)
        runner.add("a", prompt)
        logits.append(runner.step({"a": 20})["a"])
        logits[-1] = torch.cat([logits[-1], runner.step({"a": 20})["a"]])
    assert runner.kv[0][0].dtype == torch.bfloat16
    linears = [m for m in bf16.layers.modules() if hasattr(m, "packed")]
    assert all(m.packed.dtype == torch.bfloat16 and m.weight.is_meta for m in linears)
    assert (logits[0] - logits[1]).abs().max() < 0.05 * logits[0].abs().max()


def test_bfloat16_is_refused_on_a_cpu_without_native_bf16(monkeypatch, tiny_model_dir):
    """Without AVX512_BF16 or AMX torch emulates bfloat16 products far slower than float32: the
    load refuses, naming what is missing and the way out."""
    from chunkserve.config import cpu

    source = resolve_model(tiny_model_dir)
    config = load_model_config(source)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    with pytest.raises(InvalidRequestError, match=r"AVX512_BF16 or AMX.*use --dtype float32"):
        load_model(source, config, "bfloat16", 256)
    load_model(source, config, "float32", 256)


def test_missing_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(str(tmp_path / "nowhere"))


def test_folder_without_weights_names_what_is_missing(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"\*\.safetensors"):
        resolve_model(str(tmp_path))


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_model_config(resolve_model(str(tmp_path)))


def test_with_the_cpp_ops_a_gguf_linear_keeps_its_blocks_and_packed_weight_only(cpp_ops, hf_default_model):
    """The float32 copy of a layer that has both GGUF blocks and a oneDNN-packed weight is never
    read, so it is dropped (a third of the resident model); the logits still match transformers,
    in prompt chunks (packed) and decode rows (blocks)."""
    source = resolve_model(None)
    config = load_model_config(source)
    model = load_model(source, config, "float32", 1024)
    runner = PagedRunner(model, config, cpp_ops=cpp_ops)
    linears = [m for m in model.layers.modules() if hasattr(m, "packed")]
    assert linears and all(m.weight.is_meta for m in linears if m.packed is not None and m.blocks is not None)
    assert any(m.packed is not None and m.blocks is not None for m in linears)
    assert not model.embed_tokens.weight.is_meta  # the tied head reads it
    prompt = np.random.default_rng(1).integers(0, config.vocab_size, 60).tolist()
    runner.add("a", prompt)
    got = torch.cat([runner.step({"a": 58})["a"], runner.step({"a": 1})["a"], runner.step({"a": 1})["a"]])
    torch.testing.assert_close(got, reference_logits(hf_default_model, prompt), atol=1e-4, rtol=1e-4)

"""GGUF files of every architecture we serve (Llama, Qwen2, Qwen3; Mistral's are llama),
written as llama.cpp writes them (tests/model/gguf_files.py), give transformers' logits and
greedy tokens on the same weights; Q8_0 files the logits of their dequantized weights, at
decode computed from the blocks."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from chunkserve.config.model import default_model_path, resolve_model
from chunkserve.errors import ModelLoadError
from chunkserve.model.loader import gguf_reader, load_model, load_model_config
from tests.model.gguf_files import write_gguf
from tests.paged_runner import PagedRunner, reference_logits

ATOL = 1e-4


def reference_model(folder: str, matrix_type: str = "F32"):
    """transformers' model of `folder`, its matrices rounded through `matrix_type` blocks."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if matrix_type != "F32":
        ggml_type = gguf.GGMLQuantizationType[matrix_type]
        with torch.no_grad():
            for param in reference.parameters():
                if param.dim() == 2:
                    rounded = gguf.quants.dequantize(gguf.quants.quantize(param.numpy(), ggml_type), ggml_type)
                    param.copy_(torch.from_numpy(rounded))
    return reference


def load(path: str):
    source = resolve_model(path)
    config = load_model_config(source)
    return load_model(source, config, "float32", 512), config


def test_gguf_gives_transformers_logits_and_greedy_tokens(tiny_model_dir, tmp_path):
    reference = reference_model(tiny_model_dir)
    model, config = load(write_gguf(tiny_model_dir, str(tmp_path / "tiny.gguf")))
    prompt = np.random.default_rng(0).integers(0, config.vocab_size, 150).tolist()
    runner = PagedRunner(model, config)
    runner.add("a", prompt)
    got = torch.cat([runner.step({"a": count})["a"] for count in (64, 64, 22)])
    expected = reference_logits(reference, prompt)
    assert expected.std() > 0.1, "random weights too small for a meaningful comparison"
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-4)

    tokens, expected_tokens = list(prompt), list(prompt)
    for _ in range(16):
        expected_tokens.append(int(reference_logits(reference, expected_tokens)[-1].argmax()))
        tokens.append(int(got[-1].argmax()))
        runner.tokens["a"] = tokens
        got = runner.step({"a": 1})["a"]
    assert tokens == expected_tokens


@pytest.mark.parametrize("backend", ["torch", "cpp"])
def test_q8_0_gguf_gives_the_logits_of_its_dequantized_weights(tiny_model_dir, tmp_path, backend, request):
    """With the C++ ops the one-row decode steps read the Q8_0 blocks (the q/k rows of a
    Llama un-permuted in them too)."""
    ops = request.getfixturevalue("cpp_ops") if backend == "cpp" else None
    reference = reference_model(tiny_model_dir, "Q8_0")
    model, config = load(write_gguf(tiny_model_dir, str(tmp_path / "tiny-q8_0.gguf"), "Q8_0"))
    assert model.layers[0].self_attn.qkv_proj.blocks.ggml_type == gguf.GGMLQuantizationType.Q8_0
    prompt = np.random.default_rng(1).integers(0, config.vocab_size, 40).tolist()
    runner = PagedRunner(model, config, cpp_ops=ops)
    runner.add("a", prompt)
    got = [runner.step({"a": 30})["a"]] + [runner.step({"a": 1})["a"] for _ in range(10)]
    torch.testing.assert_close(torch.cat(got), reference_logits(reference, prompt), atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("tiny_model_dir", ["qwen3"], indirect=True)
def test_engine_serves_a_gguf_with_its_own_tokenizer(tiny_model_dir, tmp_path, monkeypatch, default_tokenizer):
    """The whole path a user takes: `LLM(model="x.gguf")` tokenizes with the file's tokenizer
    and generates transformers' greedy tokens."""
    from chunkserve import LLM, SamplingParams

    monkeypatch.setenv("CHUNKSERVE_CACHE", str(tmp_path / "cache"))  # where the GGUF's tokenizer is saved
    path = write_gguf(tiny_model_dir, str(tmp_path / "tiny.gguf"), tokenizer_from=default_model_path())
    llm = LLM(path, dtype="float32", max_num_batched_tokens=64, max_num_seqs=4, num_kv_blocks=64)
    try:
        prompt = "The capital of France is"
        output = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                              use_tqdm=False)[0]
    finally:
        llm.engine.shutdown()
    assert output.prompt_token_ids == default_tokenizer(prompt)["input_ids"]
    reference, expected = reference_model(tiny_model_dir), list(output.prompt_token_ids)
    for _ in range(12):
        expected.append(int(reference_logits(reference, expected)[-1].argmax()))
    assert list(output.outputs[0].token_ids) == expected[len(output.prompt_token_ids):]


def test_unsupported_gguf_architecture_names_the_supported_ones(tmp_path):
    path = str(tmp_path / "gemma.gguf")
    writer = gguf.GGUFWriter(path, "gemma2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="'gemma2'.*llama, qwen2, qwen3"):
        load_model_config(resolve_model(path))


def test_the_fast_reader_reads_every_field_and_tensor_as_ggufs_own(tiny_gguf):
    """gguf_reader parses through a plain view of the memory map (the loader says why): every
    metadata field (parts, their dtypes, values) and every tensor (type, shape, bytes) is what
    gguf.GGUFReader reads from the same file."""
    fast, own = gguf_reader(tiny_gguf), gguf.GGUFReader(tiny_gguf)
    assert list(fast.fields) == list(own.fields)
    for key, field in own.fields.items():
        mine = fast.fields[key]
        assert (mine.data, mine.types) == (field.data, field.types), key
        assert [(p.dtype, p.tobytes()) for p in mine.parts] == [(p.dtype, p.tobytes()) for p in field.parts], key
        assert mine.contents() == field.contents(), key
    assert [(t.name, t.tensor_type, t.shape.tolist(), t.data.shape) for t in fast.tensors] == [
        (t.name, t.tensor_type, t.shape.tolist(), t.data.shape) for t in own.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(fast.tensors, own.tensors))

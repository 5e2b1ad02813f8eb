"""Our model's logits equal transformers' on the same weights, for every chunk size and
with other requests' decodes in the same flat batch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from chunkserve.config.model import resolve_model
from chunkserve.model.llama import Linear
from chunkserve.model.loader import load_model, load_model_config
from chunkserve.config.cpu import native_bf16
from tests.paged_runner import PagedRunner, reference_logits

ATOL = 1e-4


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    source = resolve_model(tiny_model_dir)
    config = load_model_config(source)
    return reference, load_model(source, config, "float32", 512), config


@pytest.mark.parametrize("chunk", [None, 1, 7, 16, 64])
def test_prompt_logits_match_transformers_for_any_chunk_size(models, chunk):
    reference, model, config = models
    prompt = np.random.default_rng(1).integers(0, config.vocab_size, 150).tolist()
    expected = reference_logits(reference, prompt)
    assert expected.std() > 0.1, "random weights too small for a meaningful comparison"
    runner = PagedRunner(model, config)
    runner.add("a", prompt)
    chunk = chunk or len(prompt)
    got = torch.cat([runner.step({"a": min(chunk, len(prompt) - s)})["a"] for s in range(0, len(prompt), chunk)])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=1e-4)


def test_deterministic_mode_in_float32_keeps_transformers_logits(models, cpp_ops):
    """`--deterministic`'s kernels sum in their own order: still transformers' logits, to the tolerance."""
    reference, model, config = models
    prompt = np.random.default_rng(2).integers(0, config.vocab_size, 150).tolist()
    runner = PagedRunner(model, config, cpp_ops=cpp_ops, deterministic=True)
    runner.add("a", prompt)
    got = torch.cat([runner.step({"a": min(16, len(prompt) - s)})["a"] for s in range(0, len(prompt), 16)])
    torch.testing.assert_close(got, reference_logits(reference, prompt), atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("chunk", [7, 64])
def test_chunks_mixed_with_other_requests_decodes(models, chunk, backend, request):
    """A chunked prompt and four decoding requests share every forward; the decodes' contexts
    differ enough to be attended in separate groups whose rows interleave (torch), or are
    read in place through their block tables, the linear layers of the 11-row steps run by
    the C++ kernel and of the 68-row steps by oneDNN on weights packed at set-up (cpp)."""
    reference, model, config = models
    rng = np.random.default_rng(2)
    ops = request.getfixturevalue("cpp_ops") if backend == "cpp" else None
    runner = PagedRunner(model, config, cpp_ops=ops)
    layers = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
    assert {m.packed is not None for m in layers} == {backend == "cpp" and torch.backends.mkldnn.is_available()}
    assert model.lm_head is None or model.lm_head.packed is None
    decoders = {f"d{i}": rng.integers(0, config.vocab_size, n).tolist() for i, n in enumerate((5, 80, 7, 33))}
    for request_id, tokens in decoders.items():
        runner.add(request_id, tokens)
        runner.step({request_id: len(tokens) - 1})  # prefill all but the last token
    prompt = rng.integers(0, config.vocab_size, 130).tolist()
    runner.add("p", prompt)
    got_prompt = []
    for start in range(0, len(prompt), chunk):
        work = {"p": min(chunk, len(prompt) - start)}
        for request_id, tokens in decoders.items():
            work[request_id] = 1
            if runner.computed[request_id] == len(tokens):
                tokens.append(int(rng.integers(0, config.vocab_size)))
                runner.tokens[request_id] = tokens
        rows = runner.step(work)
        got_prompt.append(rows["p"])
        for request_id, tokens in decoders.items():
            expected = reference_logits(reference, tokens[: runner.computed[request_id]])[-1]
            torch.testing.assert_close(rows[request_id][0], expected, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(torch.cat(got_prompt), reference_logits(reference, prompt), atol=ATOL, rtol=1e-4)


def test_a_pure_decode_step_runs_its_layers_in_one_call_with_the_same_logits(cpp_ops, tiny_model_dir):
    """Pure decode steps below oneDNN's rows go through `decoder_layers`, one C++ call for the
    whole stack (or, beside a KV connector, one a layer), and give bit for bit the logits of the
    same kernels called layer part by layer part (Llama, Qwen2's q/k/v bias; Qwen3's q/k norms
    keep the per-part path); steps with a prompt chunk keep the per-part path."""
    assert_one_call_layers_equal_the_parts(cpp_ops, tiny_model_dir)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_call_layers_read_gguf_blocks_with_the_same_logits(cpp_ops, tiny_gguf, dtype):
    """Also in bfloat16 mode, whose decode steps read the blocks and write a bfloat16 KV cache."""
    if dtype == "bfloat16" and not native_bf16():
        pytest.skip("bfloat16 mode needs a CPU with native bfloat16")
    assert_one_call_layers_equal_the_parts(cpp_ops, tiny_gguf, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_call_layers_give_the_per_part_bits_in_deterministic_mode(cpp_ops, tiny_gguf, dtype):
    """Deterministic mode keeps the one-call layer for the decode rows that read the blocks:
    it calls the kernels the per-part path calls there (bfloat16 mode: bfloat16 products)."""
    if dtype == "bfloat16" and not cpp_ops.bf16_dot_supported():
        pytest.skip("deterministic bfloat16 mode needs AVX-512 with AVX512_BF16")
    assert_one_call_layers_equal_the_parts(cpp_ops, tiny_gguf, dtype, deterministic=True)


def test_one_call_float_layers_give_the_per_part_bits_in_deterministic_mode(cpp_ops, tiny_model_dir):
    assert_one_call_layers_equal_the_parts(cpp_ops, tiny_model_dir, deterministic=True)


def assert_one_call_layers_equal_the_parts(cpp_ops, model: str, dtype: str = "float32",
                                           deterministic: bool = False) -> None:
    """The whole stack in one call, and one call a layer (as beside a KV connector), against the
    per-part path: the same logits, bit for bit, and the calls each was meant to make."""
    source = resolve_model(model)
    config = load_model_config(source)
    calls = {"stack": [], "layer": [], "parts": []}

    def counted(name, layers):
        def call(*args):
            calls[name].append((args[0].shape[0], len(args[4])))  # (rows, layers)
            return layers(*args)

        return call

    def runner(name):
        ops = dataclasses.replace(cpp_ops, **{f: counted(name, getattr(cpp_ops, f)) for f in (
            "decoder_layers", "deterministic_decoder_layers", "bf16_decoder_layers", "deterministic_bf16_decoder_layers")})
        return PagedRunner(load_model(source, config, dtype, 512), config, cpp_ops=ops, deterministic=deterministic)

    stack, per_layer, parts = runner("stack"), runner("layer"), runner("parts")
    per_layer.model.fused_layers = None
    parts.model.fused_layers = None
    for layer in parts.model.layers:
        layer.fused = None
    rng = np.random.default_rng(3)
    prompts = {f"r{i}": rng.integers(0, config.vocab_size, n).tolist() for i, n in enumerate((9, 40, 17))}
    decoded = {request_id: rng.integers(0, config.vocab_size, 4).tolist() for request_id in prompts}
    runners = (stack, per_layer, parts)
    for each in runners:
        for request_id, tokens in prompts.items():
            each.add(request_id, tokens + decoded[request_id])
    for request_id, tokens in prompts.items():
        work = {request_id: len(tokens)}
        rows = [each.step(work)[request_id] for each in runners]
        assert torch.equal(rows[0], rows[2]) and torch.equal(rows[1], rows[2])
    assert calls == {"stack": [], "layer": [], "parts": []}
    for _ in range(4):
        work = dict.fromkeys(prompts, 1)
        rows = [each.step(work) for each in runners]
        for request_id in prompts:
            assert torch.equal(rows[0][request_id], rows[2][request_id])
            assert torch.equal(rows[1][request_id], rows[2][request_id])
    # q/k norms (Qwen3) are not in the one-call layers: those models keep the per-part path
    fused = not config.qk_norm
    assert calls["stack"] == ([(len(prompts), config.num_layers)] * 4 if fused else [])
    assert calls["layer"] == ([(len(prompts), 1)] * (4 * config.num_layers) if fused else [])
    assert calls["parts"] == []

"""The C++ ops against their plain-torch references (F.linear, TORCH_OPS), and the choice
between the C++ ops and torch."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from chunkserve.ops import cpp_ops as cpp_ops_module
from chunkserve.ops.cpp_ops import (
    LOGITS_MAX_ROWS,
    ONEDNN_MIN_ROWS,
    SMALL_BATCH_MAX_ROWS,
    cpp_ops_for,
    onednn_linear,
    pack_for_onednn,
)
from chunkserve.ops.model_ops import BLOCK_TYPES, TORCH_OPS
from tests.ops.support import quantized


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, SMALL_BATCH_MAX_ROWS])
@pytest.mark.parametrize("features, depth", [(960, 576), (577, 1536), (5, 13), (3, 8)])
def test_small_batch_linear_equals_f_linear(cpp_ops, rows, features, depth):
    """Row counts across the 8-row tile, depths with and without a vector tail, odd features."""
    generator = torch.Generator().manual_seed(rows * features)
    x = torch.randn(rows, depth, generator=generator)
    weight = torch.randn(features, depth, generator=generator)
    bias = torch.randn(features, generator=generator)
    torch.testing.assert_close(cpp_ops.small_batch_linear(x, weight, None), F.linear(x, weight), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cpp_ops.small_batch_linear(x, weight, bias), F.linear(x, weight, bias),
                               rtol=1e-4, atol=1e-4)


def test_the_kernels_run_the_best_instruction_set_of_the_cpu(cpp_ops):
    has_avx512 = all(flag in _cpu_flags() for flag in ("avx512f", "avx512bw", "avx512vl", "avx512dq"))
    assert cpp_ops.cpu_isa() == ("avx512" if has_avx512 else "avx2" if "avx2" in _cpu_flags() else "portable")
    with pytest.raises(RuntimeError, match="unknown instruction set avx9"):
        cpp_ops.set_cpu_isa("avx9")


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as cpuinfo:
        return next(set(line.split(":", 1)[1].split()) for line in cpuinfo if line.startswith("flags"))


@pytest.mark.parametrize("type_name", sorted(BLOCK_TYPES))
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 16, SMALL_BATCH_MAX_ROWS])
@pytest.mark.parametrize("features, depth", [(960, 576), (13, 1536), (3, 32)])
def test_block_quantized_linear_equals_f_linear_on_the_dequantized_weight(cpp_ops, cpu_isa, type_name, rows,
                                                                           features, depth):
    """Every row tile and feature tail, over each block type's nibble or byte layout, with
    each instruction set."""
    generator = torch.Generator().manual_seed(rows * features + depth)
    x = torch.randn(rows, depth, generator=generator)
    blocks, weight = quantized(torch.randn(features, depth, generator=generator), type_name)
    bias = torch.randn(features, generator=generator)
    got = cpp_ops.block_quantized_linear(x, blocks.blocks, blocks.ggml_type, bias)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("type_name", sorted(BLOCK_TYPES))
@pytest.mark.parametrize("rows", [1, 8])
def test_block_quantized_linear_reads_exactly_the_dequantized_weights(cpp_ops, cpu_isa, type_name, rows):
    """One-hot rows pick single weights out of the product: every nibble or byte value, at every
    position of a block, must come out as the very float gguf's `dequantize` gives."""
    generator = torch.Generator().manual_seed(7)
    blocks, weight = quantized(torch.randn(24, 64, generator=generator) * 3, type_name)
    one_hot = torch.eye(64)
    got = torch.cat([cpp_ops.block_quantized_linear(one_hot[start:start + rows], blocks.blocks, blocks.ggml_type, None)
                     for start in range(0, 64, rows)])
    assert torch.equal(got, weight.T)


def test_decoder_layers_names_arguments_that_do_not_make_whole_layers(cpp_ops):
    hidden, norm, cache = torch.randn(1, 8), torch.ones(8), torch.zeros(16, 1, 4)
    weights = [torch.randn(12, 8), torch.randn(8, 4), torch.randn(8, 8), torch.randn(8, 4)]
    with pytest.raises(RuntimeError, match="got 2 K caches, 1 V caches, 4 weights, 4 types, 0 interleaved copies, "
                                           "1 biases, 1 and 1 norms"):
        cpp_ops.decoder_layers(hidden, None, torch.ones(1, 2), torch.zeros(1, 2), [cache, cache], [cache],
                               torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int32),
                               torch.ones(1, dtype=torch.int32), 16, weights, [-1] * 4, [], [None], [norm], [norm],
                               1e-6, 1, 1, 0.5, False)
    with pytest.raises(RuntimeError, match="got 1 K caches, 1 V caches, 4 weights, 4 types, 1 interleaved copies"):
        cpp_ops.decoder_layers(hidden, None, torch.ones(1, 2), torch.zeros(1, 2), [cache], [cache],
                               torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int32),
                               torch.ones(1, dtype=torch.int32), 16, weights, [-1] * 4, [None], [None], [norm], [norm],
                               1e-6, 1, 1, 0.5, False)
    with pytest.raises(RuntimeError, match="kernels must be float32, bfloat16, .* got float16"):
        cpp_ops.decoder_layers.func("float16", hidden, None, torch.ones(1, 2), torch.zeros(1, 2), [cache], [cache],
                                    torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int32),
                                    torch.ones(1, dtype=torch.int32), 16, weights, [-1] * 4, [], [None], [norm],
                                    [norm], 1e-6, 1, 1, 0.5, False)


def test_block_quantized_linear_names_a_bad_type_or_shape(cpp_ops):
    blocks, _ = quantized(torch.randn(4, 64), "Q4_1")
    with pytest.raises(RuntimeError, match="ggml type 12 is not Q4_0 \\(2\\), Q4_1 \\(3\\) or Q8_0 \\(8\\)"):
        cpp_ops.block_quantized_linear(torch.randn(1, 64), blocks.blocks, 12, None)
    with pytest.raises(RuntimeError, match="x must be \\[M, 64\\]"):
        cpp_ops.block_quantized_linear(torch.randn(1, 32), blocks.blocks, blocks.ggml_type, None)


def test_small_batch_linear_takes_a_non_contiguous_input(cpp_ops):
    x = torch.randn(40, 64)[::5]  # 8 rows with a stride of 5 rows
    weight = torch.randn(32, 64)
    torch.testing.assert_close(cpp_ops.small_batch_linear(x, weight, None), F.linear(x, weight), rtol=1e-4, atol=1e-4)


def test_linears_hand_only_small_float32_batches_to_the_kernel(cpp_ops):
    rows_seen = []

    def recording_kernel(x, weight, bias):
        rows_seen.append(x.shape[0])
        return F.linear(x, weight, bias)

    ops = dataclasses.replace(cpp_ops, small_batch_linear=recording_kernel)
    weight = torch.randn(16, 8)
    for rows in (1, SMALL_BATCH_MAX_ROWS, SMALL_BATCH_MAX_ROWS + 1):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(ops.linear(x, weight), F.linear(x, weight))
    ops.linear(torch.randn(4, 8, dtype=torch.float64), weight.double())
    assert rows_seen == [1, SMALL_BATCH_MAX_ROWS]
    rows_seen.clear()
    for rows in (SMALL_BATCH_MAX_ROWS + 1, LOGITS_MAX_ROWS, LOGITS_MAX_ROWS + 1):
        ops.logits(torch.randn(rows, 8), weight)
    assert rows_seen == [SMALL_BATCH_MAX_ROWS + 1, LOGITS_MAX_ROWS]


def test_a_weight_with_blocks_is_read_from_them_up_to_the_same_row_limits(cpp_ops):
    block_rows_seen = []

    def recording_kernel(x, blocks, ggml_type, bias, int8_activations):
        block_rows_seen.append(x.shape[0])
        return cpp_ops.block_quantized_linear(x, blocks, ggml_type, bias, int8_activations)

    ops = dataclasses.replace(cpp_ops, block_quantized_linear=recording_kernel,
                              small_batch_linear=lambda *args: pytest.fail("the float kernel ran"))
    blocks, weight = quantized(torch.randn(16, 64), "Q8_0")
    for rows in (1, SMALL_BATCH_MAX_ROWS, SMALL_BATCH_MAX_ROWS + 1):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(ops.linear(x, weight, None, blocks), F.linear(x, weight), rtol=1e-4, atol=1e-4)
    ops.logits(torch.randn(LOGITS_MAX_ROWS, 64), weight, None, blocks)
    ops.logits(torch.randn(LOGITS_MAX_ROWS + 1, 64), weight, None, blocks)
    assert block_rows_seen == [1, SMALL_BATCH_MAX_ROWS, LOGITS_MAX_ROWS]


@pytest.mark.parametrize("rows", [1, ONEDNN_MIN_ROWS - 1, ONEDNN_MIN_ROWS, 300])
@pytest.mark.parametrize("features, depth", [(960, 576), (577, 1536), (5, 13)])
def test_onednn_linear_on_the_packed_weight_equals_f_linear(rows, features, depth):
    """Needs oneDNN, which every build of the pinned torch ships (x86 and ARM CPU wheels alike);
    the fallback where it is missing is the next test."""
    generator = torch.Generator().manual_seed(rows + features)
    x = torch.randn(rows, depth, generator=generator)
    weight = torch.randn(features, depth, generator=generator)
    bias = torch.randn(features, generator=generator)
    packed = pack_for_onednn(weight)
    assert packed is not None, "this torch cannot pack weights for oneDNN"
    torch.testing.assert_close(onednn_linear(x, packed, None), F.linear(x, weight), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(onednn_linear(x[::2], packed, bias), F.linear(x[::2], weight, bias), rtol=1e-4, atol=1e-4)
    assert pack_for_onednn(weight.double()) is None


@pytest.mark.parametrize("missing", ["oneDNN", "the reorder op"])
def test_without_onednn_no_weight_is_packed(monkeypatch, caplog, missing):
    """The layers then keep the C++ kernel and MKL; a oneDNN that lacks the op is said once."""
    if missing == "oneDNN":
        monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    else:
        def no_reorder(*args):
            raise RuntimeError("no such op")

        monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", no_reorder)
    cpp_ops_module._onednn_packing_works.cache_clear()
    try:
        assert pack_for_onednn(torch.randn(16, 8)) is None and pack_for_onednn(torch.randn(4, 8)) is None
    finally:
        cpp_ops_module._onednn_packing_works.cache_clear()
    warnings = [r for r in caplog.records if "oneDNN cannot pack weights here" in r.getMessage()]
    assert len(warnings) == (1 if missing == "the reorder op" else 0)


def test_a_packed_weight_takes_the_batches_from_onednn_min_rows(cpp_ops):
    """Below ONEDNN_MIN_ROWS the kernel reads the blocks; from there on oneDNN reads the
    packed weight, whatever the blocks (float32 only)."""
    routes = []
    ops = dataclasses.replace(
        cpp_ops,
        block_quantized_linear=lambda x, *rest: routes.append(("blocks", x.shape[0])) or torch.zeros(x.shape[0], 16),
        onednn_linear=lambda x, packed, bias: routes.append(("onednn", x.shape[0])) or torch.zeros(x.shape[0], 16),
    )
    blocks, weight = quantized(torch.randn(16, 64), "Q8_0")
    packed = torch.empty(0)  # never read: the recording op stands in for oneDNN
    for rows in (1, ONEDNN_MIN_ROWS - 1, ONEDNN_MIN_ROWS, SMALL_BATCH_MAX_ROWS + 1):
        ops.linear(torch.randn(rows, 64), weight, None, blocks, packed)
    ops.linear(torch.randn(ONEDNN_MIN_ROWS, 64, dtype=torch.float64), weight.double(), None, None, packed)
    assert routes == [("blocks", 1), ("blocks", ONEDNN_MIN_ROWS - 1), ("onednn", ONEDNN_MIN_ROWS),
                      ("onednn", SMALL_BATCH_MAX_ROWS + 1)]


@pytest.mark.parametrize("rows", [1, 8, 300])
def test_layer_ops_equal_the_torch_reference(cpp_ops, rows):
    generator = torch.Generator().manual_seed(rows)
    ours, reference = cpp_ops.model_ops(), TORCH_OPS

    def close(got, expected):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)

    x, residual = torch.randn(rows, 576, generator=generator), torch.randn(rows, 576, generator=generator)
    weight = torch.randn(576, generator=generator)
    close(ours.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))
    heads = torch.randn(rows, 9, 64, generator=generator)[:, 1:7]  # not contiguous: a view of every row
    close(ours.rms_norm(heads, weight[:64], 1e-6), reference.rms_norm(heads, weight[:64], 1e-6))

    expected_norm, expected_residual = reference.add_rms_norm(x, residual.clone(), weight, 1e-5)
    got_norm, got_residual = ours.add_rms_norm(x, residual, weight, 1e-5)
    close(got_norm, expected_norm)
    close(got_residual, expected_residual)

    qkv = torch.randn(rows, 960, generator=generator)  # q, k, v as views of one row, as in the layer
    angles = torch.rand(rows, 32, generator=generator) * 100
    cos, sin = angles.cos(), angles.sin()
    q, k, _ = qkv.clone().split([576, 192, 192], dim=-1)
    expected_q, expected_k = reference.rotary(q.view(rows, 9, 64), k.view(rows, 3, 64), cos, sin)
    q, k, _ = qkv.clone().split([576, 192, 192], dim=-1)
    got_q, got_k = ours.rotary(q.view(rows, 9, 64), k.view(rows, 3, 64), cos, sin)
    close(got_q, expected_q)
    close(got_k, expected_k)

    gate_up = torch.randn(rows, 2 * 1536, generator=generator) * 4
    close(ours.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))


def test_backend_choice(cpp_ops):
    assert cpp_ops_for("torch") is None
    assert cpp_ops_for("auto") is cpp_ops and cpp_ops_for("cpp") is cpp_ops
    with pytest.raises(ValueError, match="op backend must be one of"):
        cpp_ops_for("cuda")


def test_auto_falls_back_to_torch_where_the_ops_cannot_build(monkeypatch, caplog):
    def failed_build():
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpp_ops_module, "build_cpp_ops", failed_build)
    assert cpp_ops_for("auto") is None
    assert "could not be built (no C++ compiler); using plain torch" in caplog.text
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        cpp_ops_for("cpp")


def test_a_lock_left_by_a_killed_build_does_not_block_the_next_start(cpp_ops, tmp_path):
    """torch's build lock is a plain file: a build killed while it held it made every later start
    wait forever. The next start clears it (the ops load from the cache: seconds)."""
    directory = cpp_ops_module.build_directory()
    lock = os.path.join(directory, "lock")
    open(lock, "x").close()
    try:
        result = subprocess.run([sys.executable, "-c", "from chunkserve.ops.cpp_ops import build_cpp_ops as b; b()"],
                                capture_output=True, text=True, timeout=240)
        assert result.returncode == 0, result.stderr
        assert "left by a build of the C++ ops that was stopped" in result.stderr
        assert not os.path.exists(lock)
    finally:
        if os.path.exists(lock):
            os.remove(lock)

"""The C++ small-batch linear (csrc/small_batch_linear.cpp) against MKL's GEMM (F.linear) and
oneDNN's linear on weights packed once (what vLLM's CPU build and torch's inductor use).

For SmolLM2-135M's layer shapes (fused qkv, o, fused gate/up, down: one weight per layer, 30
layers, so the weights come from memory as in a real step; the LM head once) and a range of
row counts: the time of all of them, per shape, by MKL, by the C++ kernel on float32 weights,
by the C++ kernel on the GGUF blocks the default model ships (Q4_1 layers, a Q8_0 LM head),
the same with 8-bit activations (`--int8-activations`, where the CPU has AVX-512 VNNI), and by
oneDNN on float32 weights reordered for it at load. This is how the row ranges in
chunkserve/ops/cpp_ops.py were chosen. Weights are random: only shapes matter here.

    .venv/bin/python -m benchmarks.kernels.small_batch_linear [--rows 1 8 16 32 64] [--repeats 5] [--cpu-isa avx2]
    .venv/bin/python -m benchmarks.kernels.small_batch_linear --smoke   # the o shape, 2 layers, 1 and 4 rows: does it run?
    .venv/bin/python -m benchmarks.kernels.small_batch_linear --deterministic [--rows 1 8 512] [--smoke]

`--deterministic` instead times the layer ops the engine runs, default against deterministic
mode (`CppOps.model_ops(dtype, deterministic=True)`), in float32 and in bfloat16 mode, on the
GGUF blocks and the weights packed from them as a model loads them.

`--cpu-isa` runs the C++ kernels with another instruction set the CPU has (default: its best;
the AVX-512 block kernel reads the blocks in registers, the AVX2 one through an L1 buffer).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import gguf
import torch
import torch.nn.functional as F

from benchmarks.support import add_smoke_flag  # benchmarks/support.py

from chunkserve.ops.cpp_ops import CppOps, build_cpp_ops, onednn_linear, pack_for_onednn
from chunkserve.ops.model_ops import BlockWeight, ModelOps

LAYERS = 30
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
Q4_1, Q8_0 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0


def median_ms(run: Callable[[], object], repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 48, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cpu-isa", choices=["avx512", "avx2", "portable"], default=None)
    parser.add_argument("--deterministic", action="store_true",
                        help="time the default mode's layer ops against deterministic mode's")
    add_smoke_flag(parser)
    args = parser.parse_args()
    shapes, layers = (SHAPES, LAYERS) if not args.smoke else ({"o": SHAPES["o"]}, 2)
    if args.smoke:
        args.rows, args.repeats = [1, 4], 1
    ops = build_cpp_ops()
    if args.cpu_isa:
        ops.set_cpu_isa(args.cpu_isa)
    print(f"C++ kernels: {ops.cpu_isa()}")
    if args.deterministic:
        return compare_deterministic(ops, shapes, layers, args.rows, args.repeats)
    weights, blocks, packed = {}, {}, {}
    for name, shape in shapes.items():
        copies = 1 if name == "lm_head" else layers
        weights[name] = [torch.randn(shape) for _ in range(copies)]
        packed[name] = [pack_for_onednn(w) for w in weights[name]]
        block_type = Q8_0 if name == "lm_head" else Q4_1
        quantized = torch.from_numpy(gguf.quants.quantize(weights[name][0].numpy(), block_type))
        blocks[name] = [(quantized.clone(), int(block_type)) for _ in range(copies)]  # distinct memory, as 30 layers
    int8 = ops.cpu_has_vnni() and ops.cpu_isa() == "avx512"
    print(f"{'rows':>5}{'MKL ms':>9}{'C++ ms':>9}{'blocks ms':>11}{'int8 ms':>9}{'oneDNN ms':>11}{'C++/MKL':>9}"
          f"{'blocks/MKL':>12}{'oneDNN/MKL':>12}   per shape, MKL / C++ / blocks / int8 / oneDNN ms")
    for rows in args.rows:
        totals = [0.0] * 5
        per_shape = []
        for name, shape in shapes.items():
            x = torch.randn(rows, shape[1])
            times = [
                median_ms(lambda: [F.linear(x, w) for w in weights[name]], args.repeats),
                median_ms(lambda: [ops.small_batch_linear(x, w, None) for w in weights[name]], args.repeats),
                median_ms(lambda: [ops.block_quantized_linear(x, b, t, None) for b, t in blocks[name]], args.repeats),
                median_ms(lambda: [ops.block_quantized_linear(x, b, t, None, True) for b, t in blocks[name]],
                          args.repeats) if int8 else float("nan"),
                median_ms(lambda: [onednn_linear(x, p, None) for p in packed[name]], args.repeats),
            ]
            totals = [total + t for total, t in zip(totals, times)]
            per_shape.append(f"{name} " + "/".join(f"{t:.1f}" for t in times))
        mkl, cpp, quantized, int8_total, onednn = totals
        print(f"{rows:>5}{mkl:>9.1f}{cpp:>9.1f}{quantized:>11.1f}{int8_total:>9.1f}{onednn:>11.1f}{mkl / cpp:>8.2f}x"
              f"{mkl / quantized:>11.2f}x{mkl / onednn:>11.2f}x   "
              + ", ".join(per_shape))


def compare_deterministic(ops: CppOps, shapes: dict[str, tuple[int, int]], layers: int, rows: list[int],
                          repeats: int) -> None:
    """Per dtype and row count: the time of every shape's layers (and the head) through the
    default mode's ops and through deterministic mode's, each on the weights as it packs them."""
    print(f"{'dtype':>9}{'rows':>6}{'default ms':>12}{'determ. ms':>12}{'ratio':>8}   per shape, default / deterministic ms")
    weights = {}
    for name, shape in shapes.items():
        block_type = Q8_0 if name == "lm_head" else Q4_1
        quantized = gguf.quants.quantize(torch.randn(shape).numpy(), block_type)
        floats = torch.from_numpy(gguf.quants.dequantize(quantized, block_type)).float().contiguous()
        blocks = BlockWeight(int(block_type), torch.from_numpy(quantized))
        copies = 1 if name == "lm_head" else layers  # distinct memory, as 30 layers
        weights[name] = [(floats.clone(), BlockWeight(blocks.ggml_type, blocks.blocks.clone())) for _ in range(copies)]
    for dtype in (torch.float32, torch.bfloat16):
        modes = [_packed_layers(ops.model_ops(dtype, deterministic=deterministic), weights) for deterministic in (False, True)]
        for count in rows:
            totals, per_shape = [0.0, 0.0], []
            for name, shape in shapes.items():
                x = torch.randn(count, shape[1])
                times = [median_ms(lambda: [run(x) for run in mode[name]], repeats) for mode in modes]
                totals = [total + t for total, t in zip(totals, times)]
                per_shape.append(f"{name} {times[0]:.1f}/{times[1]:.1f}")
            print(f"{str(dtype).removeprefix('torch.'):>9}{count:>6}{totals[0]:>12.1f}{totals[1]:>12.1f}"
                  f"{totals[1] / totals[0]:>7.2f}x   " + ", ".join(per_shape))


def _packed_layers(model_ops: ModelOps, weights: dict[str, list[tuple[torch.Tensor, BlockWeight]]]
                   ) -> dict[str, list[Callable[[torch.Tensor], torch.Tensor]]]:
    """Each shape's layers as `model_ops` computes them: x -> its linear (the head: logits) on the
    weight as `LlamaModel.set_ops` leaves it (blocks, and the packed weight where it packs one)."""
    layers = {}
    for name, copies in weights.items():
        head = name == "lm_head"
        pack = model_ops.pack_logits_weight if head else model_ops.pack_linear_weight
        run = model_ops.logits if head else model_ops.linear
        layers[name] = [functools.partial(_call, run, floats, blocks, None if pack is None else pack(floats))
                        for floats, blocks in copies]
    return layers


def _call(run: Callable[..., torch.Tensor], floats: torch.Tensor, blocks: BlockWeight, packed: torch.Tensor | None,
          x: torch.Tensor) -> torch.Tensor:
    return run(x, floats, None, blocks, packed)


if __name__ == "__main__":
    main()

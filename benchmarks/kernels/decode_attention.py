"""The C++ decode attention (csrc/paged_attention.cpp) over a whole step's KV, in GB/s, and
against the same kernel at an earlier commit.

A Scenario A-sized decode step: 64 decodes with contexts of 260-300 tokens, SmolLM2-135M's
heads (9 query heads, 3 kv heads of 64), 16-slot blocks scattered at random over a pool, and
30 layers with a cache each, so that the KV comes from memory as in a real step (0.42 GB in
bfloat16, the default here, 0.83 GB with `--kv-dtype float32`). With `--baseline REV`, the
kernel as it was at REV is built beside the current one and the two run alternately, `--rounds`
times each; their outputs must agree to float32 rounding (their sums may run in other orders). The streaming read
rate (a sum over 1 GiB) is measured beside them: the rate memory gives to a plain scan. With
`--deterministic`, deterministic mode's decode op (`attention_kernels(deterministic=True)`: each
decode a 1-row chunk of the prefill op) runs beside them too; `--decodes` and `--context MIN MAX`
change the step's shape (issue 42's check: 1 and 8 decodes at contexts 128 to 2048).

    .venv/bin/python -m benchmarks.kernels.decode_attention [--baseline d0a2295] [--rounds 9] [--kv-dtype float32]
    .venv/bin/python -m benchmarks.kernels.decode_attention --deterministic --decodes 8 --context 2048 2048
    .venv/bin/python -m benchmarks.kernels.decode_attention --smoke    # 4 decodes, 2 layers, one round: does it run?
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable

import torch
from benchmarks.support import add_smoke_flag, memory_read_gb_s  # benchmarks/support.py

import chunkserve.ops.cpp_ops as cpp_ops

DECODES, MIN_CONTEXT, MAX_CONTEXT, LAYERS = 64, 260, 300, 30
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, POOL_BLOCKS = 9, 3, 64, 16, 2048
SMOKE_DECODES, SMOKE_LAYERS, SMOKE_POOL_BLOCKS = 4, 2, 128
_BINDING = """#include "ops.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention);
}
"""


def kernel_at(revision: str, build_dir: str) -> Callable[..., torch.Tensor]:
    """paged_decode_attention as csrc/ held it at `revision`, built on its own."""
    csrc = os.path.relpath(os.path.join(os.path.dirname(cpp_ops.__file__), "csrc"), _repository_root())
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{revision}:{csrc}"], capture_output=True, text=True,
                           check=True, cwd=_repository_root()).stdout.split()
    for name in names:  # the headers it may include, and the sources it may need
        source = subprocess.run(["git", "show", f"{revision}:{csrc}/{name}"], capture_output=True, text=True,
                                check=True, cwd=_repository_root()).stdout
        with open(os.path.join(build_dir, name), "w") as file:
            file.write(source)
    with open(os.path.join(build_dir, "binding.cpp"), "w") as file:
        file.write(_BINDING)
    from torch.utils.cpp_extension import load

    sources = [name for name in ("paged_attention.cpp", "cpu_isa.cpp") if name in names] + ["binding.cpp"]
    module = load(name=f"decode_attention_{revision}", build_directory=build_dir, extra_include_paths=[build_dir],
                  sources=[os.path.join(build_dir, name) for name in sources],
                  extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"], extra_ldflags=["-fopenmp"])
    return module.paged_decode_attention


def _repository_root() -> str:
    return subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True,
                          cwd=os.path.dirname(__file__)).stdout.strip()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--baseline", help="a commit whose kernel runs alternately with the current one")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--kv-dtype", choices=["float32", "bfloat16"], default="bfloat16",
                        help="the cache's dtype (bfloat16: what --dtype auto gives on a CPU with native bfloat16)")
    parser.add_argument("--deterministic", action="store_true", help="also time deterministic mode's decode op")
    parser.add_argument("--decodes", type=int, default=DECODES)
    parser.add_argument("--context", type=int, nargs=2, metavar=("MIN", "MAX"), default=(MIN_CONTEXT, MAX_CONTEXT),
                        help="each decode's context length, drawn from MIN .. MAX")
    add_smoke_flag(parser)
    return parser.parse_args()


def time_kernels(kernels: dict[str, Callable[..., torch.Tensor]], args: argparse.Namespace, kv_dtype: torch.dtype,
                 decodes: int, layers: int) -> tuple[dict[str, list[float]], int]:
    """Each kernel's step times over `layers` layers' caches, in turn per round (after checking
    they agree), and the KV bytes one step reads."""
    min_context, max_context = args.context
    max_blocks = -(-max_context // BLOCK_SIZE)
    pool_blocks = SMOKE_POOL_BLOCKS if args.smoke else max(POOL_BLOCKS, decodes * max_blocks)
    generator = torch.Generator().manual_seed(0)
    caches = [(torch.randn(pool_blocks * BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=generator).to(kv_dtype),
               torch.randn(pool_blocks * BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=generator).to(kv_dtype))
              for _ in range(layers)]
    tables = torch.randperm(pool_blocks, generator=generator)[: decodes * max_blocks].view(decodes, max_blocks)
    context_lens = torch.randint(min_context, max_context + 1, (decodes,), generator=generator)
    q = torch.randn(decodes, HEADS, HEAD_DIM, generator=generator)
    scale = HEAD_DIM**-0.5

    outputs = [kernel(q, *caches[0], tables, context_lens, BLOCK_SIZE, scale) for kernel in kernels.values()]
    if any(not torch.allclose(output, outputs[0], rtol=1e-5, atol=1e-5) for output in outputs):
        raise SystemExit("the kernels disagree")

    def step(kernel: Callable[..., torch.Tensor]) -> float:
        start = time.perf_counter()
        for k_cache, v_cache in caches:
            kernel(q, k_cache, v_cache, tables, context_lens, BLOCK_SIZE, scale)
        return time.perf_counter() - start

    times: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(1 if args.smoke else args.rounds):
        for name, kernel in kernels.items():
            times[name].append(step(kernel))
    return times, 2 * KV_HEADS * HEAD_DIM * kv_dtype.itemsize * int(context_lens.sum()) * layers


def report(times: dict[str, list[float]], kv_bytes: int, args: argparse.Namespace, decodes: int, layers: int,
           read_rate: float) -> None:
    min_context, max_context = args.context
    print(f"{decodes} decodes, contexts {min_context}-{max_context}, {layers} layers: {kv_bytes / 1e9:.2f} GB of "
          f"{args.kv_dtype} KV per step; streaming read {read_rate:.1f} GB/s")
    print("| kernel | step ms (median) | GB/s |")
    print("|---|---|---|")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"| {name} | {median * 1e3:.1f} | {kv_bytes / median / 1e9:.1f} |")
    medians = {name: statistics.median(samples) for name, samples in times.items()}
    if args.baseline:
        print(f"current / {args.baseline}: {medians['current'] / medians[args.baseline]:.2f}x the time")
    if "deterministic" in medians:
        print(f"deterministic / current: {medians['deterministic'] / medians['current']:.2f}x the time")


def main() -> None:
    args = parse_args()
    decodes, layers = (SMOKE_DECODES, SMOKE_LAYERS) if args.smoke else (args.decodes, LAYERS)
    ops = cpp_ops.build_cpp_ops()
    kernels = {"current": ops.decode_attention}
    if args.deterministic:
        kernels["deterministic"] = ops.attention_kernels(deterministic=True).decode
    with tempfile.TemporaryDirectory() as build_dir:
        if args.baseline:
            kernels[args.baseline] = kernel_at(args.baseline, build_dir)
        times, kv_bytes = time_kernels(kernels, args, getattr(torch, args.kv_dtype), decodes, layers)
        read_rate = memory_read_gb_s(repeats=3, gib=1 / 64 if args.smoke else 1.0)
    report(times, kv_bytes, args, decodes, layers, read_rate)


if __name__ == "__main__":
    main()

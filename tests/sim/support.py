"""Profiles and workloads the simulator's tests share."""

from __future__ import annotations

import argparse
import dataclasses
import math

from chunkserve.config.engine import EngineArgs
from chunkserve.sim.profile import StepTimeProfile

# About this host's default model in bfloat16: 9 ms a step, 0.8 ms a prompt row, 2 ms a decode row.
PROFILE = StepTimeProfile({"constant": 0.009, "prefill_rows": 8e-4, "decode_rows": 2e-3, "prefill_attention": 6e-7,
                           "decode_attention": 1.8e-6}, residuals=(1.0, 0.9, 1.3, 1.1, 0.95, 2.0, 1.0, 1.05),
                          step_gap_s=0.001, request_latency_s=0.05, output_latency_s=0.01)


def fields_that_differ(a: object, b: object) -> dict:
    """A dataclass's fields whose values differ between `a` and `b`: (a's, b's)."""
    return {f.name: (getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
            if getattr(a, f.name) != getattr(b, f.name)}


def engine_args(**flags) -> EngineArgs:
    """The default model's engine (its GGUF is read for the shape only), 1 GB of KV."""
    return EngineArgs(**{"kv_cache_memory_gb": 1, **flags})


def workload(**flags) -> argparse.Namespace:
    """`bench serve`'s workload flags with their defaults."""
    defaults = dict(workload="random", num_prompts=40, request_rate=math.inf, input_len=256, output_len=32,
                    range_ratio=0.0, seed=0, vocab_size=49152, streams=4, stream_input_len=64, stream_output_len=64,
                    long_prompts=2, long_len=1024, long_every=1.0, long_output_len=8, long_start=0.5,
                    prefix_len=512, num_prefixes=1, turns=3, think_time=0.5)
    return argparse.Namespace(**{**defaults, **flags})

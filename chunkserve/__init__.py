"""chunkserve: an LLM serving engine built around chunked prefill with stall-free mixed batches.

The names below load on first use, so importing a light part of the package (the benchmark
client, `SamplingParams`) does not load torch or the engine."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from chunkserve.version import VERSION as __version__

_EXPORTS = {
    "LLM": "chunkserve.entrypoints.llm",
    "CompletionOutput": "chunkserve.engine.outputs",
    "RequestOutput": "chunkserve.engine.outputs",
    "StepRecord": "chunkserve.engine.outputs",
    "EngineArgs": "chunkserve.config.engine",
    "InvalidRequestError": "chunkserve.errors",
    "ModelLoadError": "chunkserve.errors",
    "SamplingParams": "chunkserve.sampling_params",
    "BeamSearchParams": "chunkserve.sampling_params",
    "StructuredOutputsParams": "chunkserve.sampling_params",
    "Logprob": "chunkserve.engine.outputs",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from chunkserve.config.engine import EngineArgs
    from chunkserve.engine.outputs import CompletionOutput, Logprob, RequestOutput, StepRecord
    from chunkserve.entrypoints.llm import LLM
    from chunkserve.errors import InvalidRequestError, ModelLoadError
    from chunkserve.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'chunkserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

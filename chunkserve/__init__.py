"""chunkserve: an LLM serving engine built around chunked prefill with stall-free mixed batches."""

from chunkserve.config import EngineArgs
from chunkserve.engine.llm import LLM
from chunkserve.engine.outputs import CompletionOutput, RequestOutput, StepRecord
from chunkserve.errors import InvalidRequestError, ModelLoadError
from chunkserve.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "InvalidRequestError",
    "ModelLoadError",
    "RequestOutput",
    "SamplingParams",
    "StepRecord",
]
__version__ = "0.1.0"

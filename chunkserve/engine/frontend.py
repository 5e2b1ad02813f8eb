"""The frontend's request-side parts, built from the engine's arguments in one place for both
engines (LLMEngine, AsyncLLM): the input processor (with the model's image processor, for a
vision-language model), the output processor and the model's generation defaults."""

from __future__ import annotations

from typing import Any, NamedTuple

from chunkserve.config.engine import EngineArgs
from chunkserve.config.model import ModelSource
from chunkserve.engine.generation_config import generation_defaults
from chunkserve.engine.input_processor import InputProcessor
from chunkserve.engine.messages import EngineInfo
from chunkserve.engine.output_processor import OutputProcessor
from chunkserve.model.loader import load_model_config
from chunkserve.model.vlm.processing import MultiModalProcessor


class Frontend(NamedTuple):
    input_processor: InputProcessor
    output_processor: OutputProcessor
    generation_defaults: dict[str, Any]  # SamplingParams field -> value

    @classmethod
    def from_args(cls, args: EngineArgs, tokenizer: Any, source: ModelSource, info: EngineInfo) -> Frontend:
        """`info`: the running engine core's (its max_model_len bounds the request limits)."""
        input_processor = InputProcessor(tokenizer, source, info, args.request_limits(info.max_model_len),
                                         args.disaggregation_mode, args.structured_outputs(),
                                         args.multimodal_config(), multimodal_processor(source))
        return cls(input_processor, OutputProcessor(tokenizer), generation_defaults(source, args.generation_config))


def multimodal_processor(source: ModelSource) -> MultiModalProcessor | None:
    """The model's processor (images -> placeholder tokens and features), loaded once per
    frontend; None for a text-only model."""
    if source.kind != "hf":
        return None
    config = load_model_config(source)
    return None if config.multimodal is None else MultiModalProcessor.from_folder(source.path, config)

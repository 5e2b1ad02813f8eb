"""Request defaults from the model's `generation_config.json` (vLLM's `--generation-config`).

Model authors ship their recommended sampling settings there (Qwen: temperature 0.7, top_p
0.8, top_k 20, repetition_penalty 1.05); vLLM applies them to every request that does not set
the field itself, so the same request gives the same kind of answer on both servers. `auto`
reads the model folder's file (a GGUF file has none), `vllm` uses none, a folder reads its file.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from chunkserve.config.model import ModelSource
from chunkserve.errors import ModelLoadError

logger = logging.getLogger(__name__)

# generation_config.json's names -> SamplingParams' (the fields vLLM takes from it)
SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(source: ModelSource, setting: str) -> dict[str, Any]:
    """SamplingParams field -> default, for the fields the file sets."""
    if setting == "vllm":
        return {}
    folder = source.path if setting == "auto" else setting
    path = os.path.join(folder, "generation_config.json")
    if setting == "auto" and (source.kind != "hf" or not os.path.isfile(path)):
        return {}
    try:
        with open(path) as file:
            config = json.load(file)
    except (OSError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"generation config {path!r} cannot be read: {error}") from None
    defaults = {ours: config[theirs] for theirs, ours in SAMPLING_FIELDS.items() if config.get(theirs) is not None}
    if defaults:
        logger.info("request defaults from %s: %s (--generation-config vllm ignores them)", path, defaults)
    return defaults

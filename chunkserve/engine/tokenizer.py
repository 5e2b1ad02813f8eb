"""Load the tokenizer that goes with a model (its chat template included).

Building a tokenizer from GGUF metadata takes seconds, so the result is saved once under
`$CHUNKSERVE_CACHE` (default `~/.cache/chunkserve`) and reloaded from there.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

from chunkserve.config.model import ModelSource
from chunkserve.errors import ModelLoadError

logger = logging.getLogger(__name__)


def load_tokenizer(source: ModelSource) -> Any:
    from transformers import AutoTokenizer

    if source.kind == "hf":
        try:
            return AutoTokenizer.from_pretrained(source.path)
        except (OSError, ValueError) as error:
            raise ModelLoadError(f"no usable tokenizer files in {source.path!r}: {error}") from None
    cached = _gguf_cache_dir(source.path)
    if os.path.isfile(os.path.join(cached, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(cached)
    logger.info("building the tokenizer from GGUF metadata (once; cached in %s)", cached)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(source.path), gguf_file=os.path.basename(source.path))
    try:
        tokenizer.save_pretrained(cached)
    except OSError as error:
        logger.warning("could not cache the tokenizer in %s: %s", cached, error)
    return tokenizer


def _gguf_cache_dir(path: str) -> str:
    stat = os.stat(path)
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = os.environ.get("CHUNKSERVE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "chunkserve"))
    return os.path.join(root, "tokenizers", key)

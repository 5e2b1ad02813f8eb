"""Load the tokenizer that goes with a model (its chat template included), or the one
`--tokenizer` names, with `--chat-template` in place of its own.

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


JINJA_CHARS = "{}\n"  # a --chat-template with any of these is the template itself, not a file name


def load_tokenizer(source: ModelSource, tokenizer: str | None = None, chat_template: str | None = None) -> Any:
    """`tokenizer`: a Hugging Face tokenizer folder to use instead of the model's; `chat_template`:
    a Jinja template, or a file holding one, to use instead of the tokenizer's."""
    loaded = _from_folder(tokenizer) if tokenizer is not None else _model_tokenizer(source)
    if chat_template is not None:
        loaded.chat_template = read_chat_template(chat_template)
    return loaded


def read_chat_template(template: str) -> str:
    """vLLM's rule: text with braces or a newline is a template; anything else names a file."""
    if any(char in template for char in JINJA_CHARS):
        return template
    try:
        with open(template) as file:
            return file.read()
    except OSError as error:
        raise ModelLoadError(f"chat template {template!r} looks like a file name, and it cannot be read: "
                             f"{error.strerror}") from None


def _from_folder(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"no usable tokenizer files in {path!r}: {error}") from None


def _model_tokenizer(source: ModelSource) -> Any:
    from transformers import AutoTokenizer

    if source.kind == "hf":
        return _from_folder(source.path)
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

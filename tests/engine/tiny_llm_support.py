"""In-process engines on the tiny GGUF (tests/tiny_model.py) or on SmolLM2, for tests that run the
same check on either model: the default tier on the tiny one, `-m slow` on the real one
(support, not a test module)."""

from __future__ import annotations

import pytest

from chunkserve import LLM
from tests.tiny_model import TINY_MAX_POSITIONS

TINY = "tiny"
SMOLLM2 = "smollm2"


def build_llm(model: str, tiny_gguf: str | None = None, tiny_max_model_len: int = TINY_MAX_POSITIONS,
              **engine_args) -> LLM:
    """An engine on `model` (TINY or SMOLLM2) with a small KV pool unless `engine_args` sizes it;
    on the tiny model, `tiny_max_model_len` (without chunked prefill one step takes a whole prompt
    up to max_model_len, and a KV pool must hold max_model_len)."""
    args = dict(engine_args)
    args.setdefault("dtype", "float32")  # the exact mode, whose tokens the tests compare across configurations
    if "num_kv_blocks" not in args:
        args.setdefault("kv_cache_memory_gb", 0.25)
    if model == TINY:
        return LLM(model=tiny_gguf, max_model_len=args.pop("max_model_len", tiny_max_model_len), **args)
    return LLM(**args)


def over_models(*values, ids=None):
    """pytest params: each value on the tiny model, and again on SmolLM2 in the slow tier."""
    params = []
    for index, value in enumerate(values):
        suffix = f"-{ids[index]}" if ids else ""
        params.append(pytest.param(TINY, value, id=f"{TINY}{suffix}"))
        params.append(pytest.param(SMOLLM2, value, id=f"{SMOLLM2}{suffix}", marks=pytest.mark.slow))
    return params

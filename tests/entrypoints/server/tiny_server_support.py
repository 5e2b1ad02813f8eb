"""A server on the tiny model (tests/tiny_model.py) for the HTTP behaviour tests, and the
in-process engine with the same flags that its answers must equal.

The flags match the session `server` fixture's budget (64 batched tokens, 32 sequences), so a
test moved from SmolLM2 exercises the same chunking and batching.
"""

from __future__ import annotations

from tests.server_process import Server, start_server
from tests.tiny_model import TINY_SERVER_ENV, tiny_server_flags

BUDGET_FLAGS = ("--max-num-batched-tokens", "64", "--max-num-seqs", "32")


def start_tiny_server(tmp_path_factory, tiny_gguf: str, *flags: str, name: str,
                      env: dict[str, str] | None = None, trace_steps: bool = False) -> Server:
    """A tiny-model server with the session server's budget; `trace_steps` also writes
    --trace-steps to `server.trace_path`."""
    trace_flags: tuple[str, ...] = ()
    trace_path = None
    if trace_steps:
        trace_path = str(tmp_path_factory.mktemp(f"{name}-trace") / "steps.jsonl")
        trace_flags = ("--trace-steps", trace_path)
    started = start_server(tmp_path_factory, *tiny_server_flags(tiny_gguf), *BUDGET_FLAGS, *trace_flags, *flags,
                           name=name, env={**TINY_SERVER_ENV, **(env or {})})
    started.trace_path = trace_path
    return started


def tiny_offline_llm(tiny_gguf: str):
    """The in-process engine with the tiny server's flags: greedy answers must match it token for token."""
    from chunkserve import LLM

    return LLM(dtype="float32", model=tiny_gguf, max_model_len=4096, max_num_batched_tokens=64, kv_cache_memory_gb=0.25,
               max_num_seqs=32)

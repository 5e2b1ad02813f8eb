"""Shared helpers of the hostile-input tests (tests/entrypoints/server/test_fuzz.py and
test_soak.py): a tiny random-weight model, a server on it, OpenAI's error shape, SSE parsing
and the admin `GET /debug/check` probe.

The server runs on a 2-layer, 64-wide Llama with the default tokenizer (built with
transformers, nothing downloaded), so any valid request finishes in well under a second.
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx

from tests.server_process import ADMIN_API_KEY, API_KEY, Server, start_server

TINY_MAX_MODEL_LEN = 128
ERROR_KEYS = {"message", "type", "param", "code"}


def build_tiny_model(folder: str) -> str:
    """A Hugging Face folder: a tiny random Llama (seeded) with the default tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from chunkserve.config.model import resolve_model
    from chunkserve.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(None))
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         tie_word_embeddings=True, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def start_tiny_server(tmp_path_factory, *flags: str, name: str, max_model_len: int = TINY_MAX_MODEL_LEN) -> Server:
    """The real server (subprocess) on the tiny model, with the API and admin keys of
    tests/server_process.py."""
    model_dir = build_tiny_model(str(tmp_path_factory.mktemp(f"{name}-model")))
    # One intra-op thread: the tiny model gains nothing from more, and on a 2-core machine
    # shared with the test client (and other tests) torch's spinning threads made every
    # step about 8x slower.
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        return start_server(tmp_path_factory, "--model", model_dir, "--max-model-len", str(max_model_len), *flags,
                            name=name)
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]


def auth(key: str = API_KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def error_shape_problem(status: int, content: bytes) -> str | None:
    """None if `content` is OpenAI's error body for `status`, else what is wrong with it."""
    try:
        body = json.loads(content)
    except ValueError:
        return f"the body is not JSON: {content[:200]!r}"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(error) != ERROR_KEYS or set(body) != {"error"}:
        return f"not OpenAI's error shape: {str(body)[:300]}"
    if not isinstance(error["message"], str) or not error["message"]:
        return f"the error has no message: {error}"
    if not isinstance(error["type"], str) or error["code"] != status:
        return f"the error's type/code do not match HTTP {status}: {error}"
    if error["param"] is not None and not isinstance(error["param"], str):
        return f"the error's param is not a string: {error}"
    return None


def sse_events(text: str) -> list[str]:
    """The `data:` payloads of a server-sent event stream, in order."""
    return [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]


def stream_error_events(events: list[str]) -> list[dict[str, Any]]:
    """The in-band error events of a stream (the server sends these once headers are out)."""
    errors = []
    for event in events:
        if event == "[DONE]":
            continue
        try:
            payload = json.loads(event)
        except ValueError:
            errors.append({"unparsable_event": event[:200]})
            continue
        if isinstance(payload, dict) and "error" in payload:
            errors.append(payload["error"])
    return errors


def debug_check(base_url: str) -> tuple[int, Any]:
    """`GET /debug/check` with the admin key: (status, parsed body or text)."""
    response = httpx.get(f"{base_url}/debug/check", headers=auth(ADMIN_API_KEY), timeout=30)
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, response.text


def check_engine_clean(server: Server) -> None:
    """Assert `GET /debug/check` says every KV block is free or cached and no request is left."""
    status, body = debug_check(server.base_url)
    assert status == 200, f"GET /debug/check answered {status}: {body}"
    assert isinstance(body, dict) and {"ok", "problems", "num_requests", "num_free_blocks", "num_cached_blocks",
                                       "num_blocks"} <= set(body), f"unexpected /debug/check body: {body}"
    assert body["ok"] is True and body["problems"] == [] and body["num_requests"] == 0, body


def server_log_tail(server: Server, chars: int = 4000) -> str:
    if not os.path.exists(server.log_path):
        return ""
    with open(server.log_path, errors="replace") as f:
        return f.read()[-chars:]

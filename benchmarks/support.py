"""What several scripts in benchmarks/ share: timing helpers, the machine's reference rates,
the smoke-mode flag and the grammar test cases. The scripts run as `python benchmarks/NAME.py`,
so this folder is on their path and they import it as `support`; no script imports another.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import subprocess
import time
from collections.abc import Callable
from typing import Any

PEERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peers")
VLLM_SCRIPT = os.path.join(PEERS, "start_vllm.sh")  # PORT [vLLM flags...]: see peers/README.md

SMOKE_HELP = ("a few seconds on the smallest shapes (tests/bench/test_scripts.py runs it): checks that the "
              "script runs; its numbers mean nothing")


def add_smoke_flag(parser: argparse.ArgumentParser, help: str = SMOKE_HELP) -> None:
    parser.add_argument("--smoke", action="store_true", help=help)


def add_model_flag(parser: argparse.ArgumentParser) -> None:
    """--model: the default model unless given (the smoke test gives a tiny one)."""
    parser.add_argument("--model", default=None,
                        help="a GGUF file or Hugging Face folder (default: the default model, SmolLM2-135M-Instruct)")


def peer_missing(script: str) -> str | None:
    """Why the peer start script `script` (benchmarks/peers/) cannot start its server here, or
    None if it can (`script --check`: its installation is there)."""
    if not os.path.isfile(script):
        return f"no {script}"
    check = subprocess.run(["bash", script, "--check"], capture_output=True, text=True)
    return None if check.returncode == 0 else (check.stderr.strip() or f"{script} --check failed")


# ----- workloads as text (benchmarks/fleet: SMG takes no token-id prompt) ----------------------

def text_workload(shape: argparse.Namespace, seed: int, tokenizer: Any) -> list:
    """`chunkserve bench serve`'s workload `shape` (its flags: workload, num_prompts, input_len,
    ...) with every prompt as text: each random token becomes a one-word token (`word_tokens`), so
    the text encodes back to exactly those tokens (a later turn's prompt still starts with the
    whole previous turn's), and `prompt_token_ids` is what the server will see."""
    import numpy as np

    from chunkserve.bench.workloads import TOKEN_ID_MARGIN, build_workload

    words = word_tokens(tokenizer)
    specs = build_workload(argparse.Namespace(**{**vars(shape), "vocab_size": len(words) + 2 * TOKEN_ID_MARGIN}),
                           np.random.default_rng(seed))
    for spec in specs:
        spec.prompt_text = tokenizer.decode([words[token - TOKEN_ID_MARGIN] for token in spec.prompt_token_ids])
        spec.prompt_token_ids = tokenizer.encode(spec.prompt_text)
    for spec in specs:
        if spec.after is not None:
            previous = specs[spec.after].prompt_token_ids
            assert spec.prompt_token_ids[:len(previous)] == previous, "a turn's tokens must extend the previous turn's"
    return specs


@functools.lru_cache(maxsize=1)
def word_tokens(tokenizer: Any) -> list[int]:
    """The tokens that are one space-led lowercase word and encode back to themselves alone
    (a byte-level BPE splits text at spaces, so a run of them encodes token for token)."""
    candidates = sorted(i for token, i in tokenizer.get_vocab().items() if re.fullmatch("\u0120[a-z]{3,}", token))
    return [i for i in candidates if tokenizer.encode(tokenizer.decode([i]), add_special_tokens=False) == [i]]


# ----- KV events (kv_events_overhead.py, peers/kv_events_conformance.py) -----------------------

class EventRecorder:
    """A ZMQ SUB socket on a thread keeping every KV-events message as (sequence number, payload),
    so a slow reader never makes the engine's PUB socket drop; `close` stops it."""

    def __init__(self, endpoint: str) -> None:
        import threading

        import zmq

        self.frames: list[tuple[int, bytes]] = []
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(100):
                _, seq, payload = self._socket.recv_multipart()
                self.frames.append((int.from_bytes(seq, "big"), payload))

    def close(self) -> list[tuple[int, bytes]]:
        self._stop.set()
        self._thread.join()
        self._socket.close(linger=0)
        self._context.term()
        return self.frames


# ----- timing -----------------------------------------------------------------------------------

def timed(run: Callable[[], object]) -> float:
    """Seconds of one call of `run`."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def gemm_peak_gflop_s(repeats: int, size: int = 2048) -> float:
    """fp32 GEMM throughput here and now: the best of `repeats` size^3 matmuls (2048: the
    reference every number in docs/benchmarks-log.md is set against)."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    best = min(timed(lambda: torch.mm(a, b)) for _ in range(repeats))
    return 2 * size**3 / best / 1e9


def memory_read_gb_s(repeats: int, gib: float = 1.0) -> float:
    """Streaming read rate here and now: the best of `repeats` sums over `gib` GiB of float32
    (1 GiB: far beyond any cache)."""
    import torch

    data = torch.ones(int(gib * (1 << 28)))
    best = min(timed(data.sum) for _ in range(repeats))
    return data.numel() * data.element_size() / best / 1e9


# ----- grammar cases (grammar_backends.py, structured_outputs.py) -------------------------------

_ADDRESS = {
    "type": "object",
    "properties": {
        "street": {"type": "string"},
        "city": {"type": "string"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "country": {"enum": ["US", "CA", "MX"]},
    },
    "required": ["city", "country"],
    "additionalProperties": False,
}
SMALL_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
NESTED_SCHEMA = {  # 31 properties, $ref, enums, arrays of objects, nested required fields
    "$defs": {"address": _ADDRESS},
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
        "priority": {"enum": ["low", "medium", "high"]},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "email": {"type": "string"},
                "phone": {"type": "string"},
                "vip": {"type": "boolean"},
                "address": {"$ref": "#/$defs/address"},
            },
            "required": ["name", "address"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "qty": {"type": "integer"},
                    "price": {"type": "number"},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "billing": {"$ref": "#/$defs/address"},
        "notes": {"type": "string"},
        "gift": {"type": "boolean"},
        "total": {"type": "number"},
        "currency": {"enum": ["USD", "EUR"]},
        "metadata": {
            "type": "object",
            "properties": {
                "source": {"type": "string"},
                "campaign": {"type": "string"},
                "created_at": {"type": "string", "format": "date-time"},
            },
            "required": ["source"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "status", "customer", "items"],
    "additionalProperties": False,
}
TOOL_SCHEMA = {  # OpenAI function parameters, strict style: every property required
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "City and country"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "include_hourly": {"type": "boolean"},
        "coordinates": {
            "anyOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"],
                    "additionalProperties": False,
                },
            ]
        },
        "alert": {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {"kind": {"const": "email"}, "address": {"type": "string"}},
                    "required": ["kind", "address"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {
                        "kind": {"const": "sms"},
                        "number": {"type": "string", "pattern": "^\\+?[0-9]{7,15}$"},
                    },
                    "required": ["kind", "number"],
                    "additionalProperties": False,
                },
            ]
        },
    },
    "required": ["location", "unit", "days", "include_hourly", "coordinates", "alert"],
    "additionalProperties": False,
}
EMAIL_REGEX = r"[a-z0-9._%+-]{1,32}@[a-z0-9-]{1,16}(\.[a-z0-9-]{1,16})*\.[a-z]{2,6}"

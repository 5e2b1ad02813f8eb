"""Engine configuration: one flat `EngineArgs` for users and the CLI, resolved into small
frozen configs, one per owner (scheduler, KV cache), once the model is known."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from chunkserve.errors import InvalidRequestError
from chunkserve.worker.cpp_ops import OP_BACKENDS

SCHEDULING_POLICIES = ("fcfs", "priority")
DEFAULT_CHUNKED_BUDGET = 512
DEFAULT_MAX_NUM_SEQS = 128
DTYPES = ("float32", "bfloat16")


def _arg(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


class CliArgs:
    """A dataclass whose fields (with `_arg` help metadata) are also command-line flags."""

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            kwargs: dict[str, Any] = {"default": f.default, "help": f.metadata["help"], "dest": f.name}
            if f.type == "bool":
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = {"int": int, "float": float}.get(f.type.split(" |")[0], str)
                if "choices" in f.metadata:
                    kwargs["choices"] = f.metadata["choices"]
            parser.add_argument(flag, **kwargs)

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> Any:
        return cls(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(cls)})


@dataclass
class EngineArgs(CliArgs):
    """Every engine knob, with vLLM's names; each is also a command-line flag."""

    model: str | None = _arg(
        None, "Hugging Face model folder or .gguf file (default: the embedded SmolLM2-135M-Instruct GGUF)"
    )
    dtype: str = _arg("float32", "weights and activations dtype", choices=DTYPES)
    max_model_len: int | None = _arg(
        None, "longest prompt + output in tokens (default: the model's limit, capped by the KV pool)"
    )
    max_num_batched_tokens: int | None = _arg(
        None,
        f"token budget of one engine step, decode + prefill tokens (default: {DEFAULT_CHUNKED_BUDGET} with "
        "chunked prefill, max_model_len without)",
    )
    max_num_seqs: int | None = _arg(
        None, f"most requests running at once (default: {DEFAULT_MAX_NUM_SEQS}, at most the step budget)"
    )
    enable_chunked_prefill: bool = _arg(
        True, "cut long prompts into chunks; off = each prompt is prefilled whole in one step"
    )
    enable_mixed_batch: bool = _arg(
        True, "put prefill chunks and decodes in one forward; off = a step is all-prefill or all-decode"
    )
    long_prefill_token_threshold: int = _arg(0, "most prompt tokens one request may prefill in one step (0: no cap)")
    max_num_partial_prefills: int = _arg(1, "most requests left with an unfinished prompt at the end of a step")
    block_size: int = _arg(16, "tokens per KV cache block (page)")
    kv_cache_memory_gb: float = _arg(2.0, "memory for the KV cache pool, GiB")
    num_kv_blocks: int | None = _arg(None, "exact number of KV blocks (overrides --kv-cache-memory-gb)")
    enable_prefix_caching: bool = _arg(
        True, "reuse the KV of full blocks shared with earlier requests (a SHA-256 hash chain over their tokens)"
    )
    scheduling_policy: str = _arg("fcfs", "order of admission and preemption", choices=SCHEDULING_POLICIES)
    op_backend: str = _arg(
        "auto", "cpp = C++ ops (built on first use): decode attention reading the paged KV in place, the "
        "linear layers of small batches, fused norm/rotary/SiLU; torch = plain torch (the reference); auto = "
        "cpp where it builds", choices=OP_BACKENDS
    )
    seed: int = _arg(0, "seed of the sampler for requests that give none")

    def __post_init__(self) -> None:
        def fail(message: str) -> None:
            raise InvalidRequestError(message)

        if self.dtype not in DTYPES:
            fail(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.op_backend not in OP_BACKENDS:
            fail(f"op_backend must be one of {OP_BACKENDS}, got {self.op_backend!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            fail(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.block_size < 1:
            fail(f"block_size must be positive, got {self.block_size}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.block_size:
            fail(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"block_size ({self.block_size}): chunks are whole blocks"
            )
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            fail(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.long_prefill_token_threshold < 0:
            fail("long_prefill_token_threshold must be non-negative")
        if 0 < self.long_prefill_token_threshold < self.block_size:
            fail(f"long_prefill_token_threshold must be 0 or at least block_size ({self.block_size})")
        if self.max_num_partial_prefills < 1:
            fail("max_num_partial_prefills must be at least 1")
        if self.kv_cache_memory_gb <= 0:
            fail("kv_cache_memory_gb must be positive")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            fail("num_kv_blocks must be positive")
        if self.max_model_len is not None and self.max_model_len < 1:
            fail("max_model_len must be positive")

@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler reads; see EngineArgs for the meaning of each field."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    block_size: int
    enable_chunked_prefill: bool = True
    enable_mixed_batch: bool = True
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"

    @classmethod
    def from_engine_args(cls, args: EngineArgs, max_model_len: int) -> SchedulerConfig:
        """Resolve the defaults that depend on the model's length limit."""
        budget = args.max_num_batched_tokens
        if budget is None:
            budget = DEFAULT_CHUNKED_BUDGET if args.enable_chunked_prefill else max(max_model_len, DEFAULT_CHUNKED_BUDGET)
        max_num_seqs = args.max_num_seqs if args.max_num_seqs is not None else min(DEFAULT_MAX_NUM_SEQS, budget)
        resolved = {"max_model_len", "max_num_batched_tokens", "max_num_seqs"}
        names = {f.name for f in dataclasses.fields(cls)} - resolved
        return cls(
            max_model_len=max_model_len,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            **{n: getattr(args, n) for n in names},
        )


@dataclass
class ServerArgs(CliArgs):
    """The HTTP server's own flags (vLLM's names where vLLM has them)."""

    host: str = _arg("127.0.0.1", "address to listen on")
    port: int = _arg(8000, "port to listen on")
    served_model_name: str | None = _arg(
        None, "the model name the API answers to (default: the model file or folder name)"
    )
    api_key: str | None = _arg(
        None, "require 'Authorization: Bearer KEY' on every endpoint but /health (default: $CHUNKSERVE_API_KEY)"
    )
    max_waiting_requests: int | None = _arg(None, "answer 503 to new requests while this many are waiting")
    max_request_body_bytes: int = _arg(16 * 1024 * 1024, "larger request bodies get 413")
    shutdown_timeout: float = _arg(
        10.0, "on SIGINT/SIGTERM, seconds in-flight requests may take to finish before they are aborted"
    )
    log_level: str = _arg("info", "server log level", choices=("debug", "info", "warning", "error"))
    trace_steps: str | None = _arg(None, "append one JSON line per engine step to this file")

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidRequestError(f"port must be in [0, 65535], got {self.port}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise InvalidRequestError("max_waiting_requests must be non-negative")
        if self.max_request_body_bytes < 1:
            raise InvalidRequestError("max_request_body_bytes must be positive")

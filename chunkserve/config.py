"""Engine configuration: one flat `EngineArgs` for users and the CLI, resolved into small
frozen configs, one per owner (scheduler, KV cache), once the model is known."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from chunkserve.core.chunking import ChunkSchedule
from chunkserve.errors import InvalidRequestError
from chunkserve.worker.cpp_ops import OP_BACKENDS

SCHEDULING_POLICIES = ("fcfs", "priority")
DEFAULT_CHUNKED_BUDGET = 512
DEFAULT_SLO_BUDGET = 2048  # with --tbt-slo-ms the SLO sizes steps; the budget is only a ceiling
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
        f"chunked prefill, {DEFAULT_SLO_BUDGET} with --tbt-slo-ms, max_model_len without chunking)",
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
    long_prefill_token_threshold: int = _arg(
        0, "most prompt tokens one request may prefill in one step, and the prompt length above which a prompt "
        "counts as long for --max-long-partial-prefills (0: no cap, no prompt is long)"
    )
    max_num_partial_prefills: int = _arg(1, "most requests left with an unfinished prompt at the end of a step")
    max_long_partial_prefills: int = _arg(
        1, "most long prompts (see --long-prefill-token-threshold) left unfinished at the end of a step; below "
        "--max-num-partial-prefills, shorter prompts pass waiting long ones"
    )
    chunk_align: int | None = _arg(
        None, "a prompt chunk that does not finish its prompt is a multiple of this many tokens, and where "
        "possible so is the step (decodes + chunks); a multiple of block_size (default: block_size)"
    )
    chunk_schedule: str | None = _arg(
        None, "Sarathi-Serve's decreasing chunks, 'high:low:stages:max_tokens': a step carrying a prompt's "
        "chunk holds at most `high` tokens, stepping down to `low` over `stages` stages of max_tokens/stages "
        "prompt tokens (e.g. 512:128:4:4096)"
    )
    tbt_slo_ms: float | None = _arg(
        None, "size each step by time instead of tokens: all decodes, then as many prompt tokens as keep the "
        "step's predicted time (a model fitted online from the engine's own steps) under this many ms"
    )
    max_prefill_wait_ms: float = _arg(
        1000.0, "with --tbt-slo-ms: a prompt that got no tokens for this long gets one aligned chunk even if "
        "the step then exceeds the SLO (decodes alone may already exceed it)"
    )
    ttft_slo_ms: float | None = _arg(
        None, "prompts whose first token can still come within this many ms of arrival get prompt tokens "
        "first, earliest deadline first; prompts that can no longer make it follow"
    )
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
        if not 1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills:
            fail(
                f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be at least 1 and at most "
                f"max_num_partial_prefills ({self.max_num_partial_prefills})"
            )
        if self.chunk_align is not None and (self.chunk_align < 1 or self.chunk_align % self.block_size):
            fail(f"chunk_align must be a positive multiple of block_size ({self.block_size}), got {self.chunk_align}")
        if self.chunk_schedule is not None:
            ChunkSchedule.parse(self.chunk_schedule)
        for name in ("tbt_slo_ms", "ttft_slo_ms"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                fail(f"{name} must be positive, got {value}")
        if self.max_prefill_wait_ms < 0:
            fail(f"max_prefill_wait_ms must be non-negative, got {self.max_prefill_wait_ms}")
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
    max_long_partial_prefills: int = 1
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    chunk_align: int | None = None  # None: block_size
    chunk_schedule: ChunkSchedule | None = None
    tbt_slo_ms: float | None = None
    max_prefill_wait_ms: float = 1000.0
    ttft_slo_ms: float | None = None

    @property
    def chunk_alignment(self) -> int:
        return self.chunk_align or self.block_size

    @classmethod
    def from_engine_args(cls, args: EngineArgs, max_model_len: int) -> SchedulerConfig:
        """Resolve the defaults that depend on the model's length limit."""
        budget = args.max_num_batched_tokens
        if budget is None:
            if not args.enable_chunked_prefill:
                budget = max(max_model_len, DEFAULT_CHUNKED_BUDGET)
            else:
                budget = DEFAULT_SLO_BUDGET if args.tbt_slo_ms is not None else DEFAULT_CHUNKED_BUDGET
        max_num_seqs = args.max_num_seqs if args.max_num_seqs is not None else min(DEFAULT_MAX_NUM_SEQS, budget)
        resolved = {"max_model_len", "max_num_batched_tokens", "max_num_seqs", "chunk_schedule"}
        names = {f.name for f in dataclasses.fields(cls)} - resolved
        return cls(
            max_model_len=max_model_len,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            chunk_schedule=None if args.chunk_schedule is None else ChunkSchedule.parse(args.chunk_schedule),
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
    disable_frontend_multiprocessing: bool = _arg(
        False, "run the engine on a thread of the server's process instead of a process of its own "
               "(slower: the server's Python work then stalls the engine's steps on the GIL)"
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidRequestError(f"port must be in [0, 65535], got {self.port}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise InvalidRequestError("max_waiting_requests must be non-negative")
        if self.max_request_body_bytes < 1:
            raise InvalidRequestError("max_request_body_bytes must be positive")

"""The engine's configuration: one flat `EngineArgs` with vLLM's names, checked on creation.
Each owner resolves the part it reads (`scheduler_config()` once the model's length limit
is known); the command line builds it from flags (entrypoints/args.py)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

from chunkserve.config.cpu import auto_dtype
from chunkserve.config.cpu_threads import parse_threads_bind, threads_bind_setting
from chunkserve.config.limits import CHARS_PER_TOKEN_BOUND, RequestLimits
from chunkserve.config.parallel import ParallelConfig, parse_layer_partition
from chunkserve.config.scheduler import (
    DEFAULT_CHUNKED_BUDGET,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_SLO_BUDGET,
    SCHEDULING_POLICIES,
    ChunkSchedule,
    SchedulerConfig,
)
from chunkserve.config.speculative import SpeculativeConfig
from chunkserve.config.structured_outputs import StructuredOutputsConfig
from chunkserve.errors import InvalidRequestError
from chunkserve.sampling_params import MAX_LOGPROBS

DTYPES = ("float32", "bfloat16")
# vLLM's spellings; float16 has no fast CPU kernels. auto is resolved for this CPU (config/cpu.py).
DTYPE_ALIASES = {"float": "float32"}
DTYPE_CHOICES = ("auto", *DTYPES, *DTYPE_ALIASES, "half", "float16")
OP_BACKENDS = ("auto", "cpp", "torch")
HICACHE_STORAGE_BACKENDS = ("file",)
HICACHE_WRITE_POLICIES = ("write_through", "write_back")
DISAGGREGATION_MODES = ("null", "prefill", "decode")
DISAGGREGATION_TRANSFER_BACKENDS = ("zmq",)
EXECUTOR_BACKENDS = ("uni", "mp")


def arg(default: Any, help: str, **extra: Any) -> Any:
    """A dataclass field that is also a command-line flag, with its help text. `extra`: choices,
    aliases (other spellings, e.g. SGLang's), negative_aliases (switches that turn a bool off),
    type (parses the flag's value), nargs."""
    return field(default=default, metadata={"help": help, **extra})


def human_readable_int(value: str) -> int:
    """vLLM's sizes on the command line: 32k = 32,000, 32K = 32,768 (2^10), 1.5m = 1,500,000;
    a binary suffix takes whole numbers only."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value.strip())
    if not match:
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not an integer (32000, 32k, 32K)") from None
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if "." in number:
        raise argparse.ArgumentTypeError(f"{value!r}: a binary suffix ({suffix}) takes a whole number; did you mean "
                                         f"{number}{suffix.lower()}?")
    return int(number) * 1024 ** ("KMGT".index(suffix) + 1)


@dataclass
class EngineArgs:
    """Every engine knob, with vLLM's names; each is also a command-line flag."""

    model: str | None = arg(
        None, "Hugging Face model folder or .gguf file, or a model id in the local Hugging Face cache (default: the "
              "embedded SmolLM2-135M-Instruct GGUF); also positional: chunkserve serve MODEL",
        aliases=("--model-path",)
    )
    tokenizer: str | None = arg(
        None, "Hugging Face tokenizer folder to use instead of the model's (default: the model's own)",
        aliases=("--tokenizer-path",)
    )
    dtype: str = arg(
        "auto", "float32: every op in float32, logits equal to transformers'; bfloat16: the linear layers' "
        "products (the GGUF blocks' decode steps of a few rows excepted) and the KV cache in bfloat16, the residual "
        "stream, norms and logits in float32: faster prompts and batched decodes under an accuracy contract "
        "(docs/PRECISION.md); needs a CPU with AVX512_BF16 or AMX (refused elsewhere: use float32); auto: bfloat16 "
        "where the CPU has it, else float32 (vLLM's rule); float means float32", choices=DTYPE_CHOICES
    )
    int8_activations: bool = arg(
        False, "GGUF Q4_0/Q4_1/Q8_0 weights: quantize the activations they multiply to 8 bits per block of 32 "
        "(llama.cpp's numerics) and multiply with integer dot products, in the steps the block kernel serves (decode "
        "and other steps of a few rows) and the LM head: faster decode under an accuracy contract (docs/PRECISION.md); "
        "needs a CPU with AVX512_VNNI and a GGUF model with such weights (refused otherwise)"
    )
    max_model_len: int | None = arg(
        None, "longest prompt + output in tokens, e.g. 4096, 32k (32,000) or 32K (32,768) (default: the model's "
              "limit, capped by the KV pool)", aliases=("--context-length",), type=human_readable_int
    )
    chat_template: str | None = arg(
        None, "a Jinja chat template, or a file holding one, used instead of the tokenizer's"
    )
    generation_config: str = arg(
        "auto", "request defaults: auto = the sampling defaults of the model folder's generation_config.json "
                "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), as vLLM; vllm = none; or "
                "a folder holding a generation_config.json"
    )
    max_logprobs: int = arg(20, "most logprobs (and prompt_logprobs) one request may ask for")
    max_num_batched_tokens: int | None = arg(
        None,
        f"token budget of one engine step, decode + prefill tokens (default: {DEFAULT_CHUNKED_BUDGET} with "
        f"chunked prefill, {DEFAULT_SLO_BUDGET} with --tbt-slo-ms, max_model_len without chunking)",
        aliases=("--chunked-prefill-size",), type=human_readable_int
    )
    max_num_seqs: int | None = arg(
        None, f"most requests running at once (default: {DEFAULT_MAX_NUM_SEQS}, at most the step budget)",
        aliases=("--max-running-requests",)
    )
    enable_chunked_prefill: bool = arg(
        True, "cut long prompts into chunks; off = each prompt is prefilled whole in one step"
    )
    enable_mixed_batch: bool = arg(
        True, "put prefill chunks and decodes in one forward; off = a step is all-prefill or all-decode"
    )
    long_prefill_token_threshold: int = arg(
        0, "most prompt tokens one request may prefill in one step, and the prompt length above which a prompt "
        "counts as long for --max-long-partial-prefills (0: no cap, no prompt is long)"
    )
    max_num_partial_prefills: int = arg(1, "most requests left with an unfinished prompt at the end of a step")
    max_long_partial_prefills: int = arg(
        1, "most long prompts (see --long-prefill-token-threshold) left unfinished at the end of a step; below "
        "--max-num-partial-prefills, shorter prompts pass waiting long ones"
    )
    chunk_align: int | None = arg(
        None, "a prompt chunk that does not finish its prompt is a multiple of this many tokens, and where "
        "possible so is the step (decodes + chunks); a multiple of block_size (default: block_size)"
    )
    chunk_schedule: str | None = arg(
        None, "Sarathi-Serve's decreasing chunks, 'high:low:stages:max_tokens': a step carrying a prompt's "
        "chunk holds at most `high` tokens, stepping down to `low` over `stages` stages of max_tokens/stages "
        "prompt tokens (e.g. 512:128:4:4096)"
    )
    tbt_slo_ms: float | None = arg(
        None, "size each step by time instead of tokens: all decodes, then as many prompt tokens as keep the "
        "step's predicted time (a model fitted online from the engine's own steps) under this many ms"
    )
    max_prefill_wait_ms: float = arg(
        1000.0, "with --tbt-slo-ms: a prompt that got no tokens for this long gets one aligned chunk even if "
        "the step then exceeds the SLO (decodes alone may already exceed it)"
    )
    ttft_slo_ms: float | None = arg(
        None, "prompts whose first token can still come within this many ms of arrival get prompt tokens "
        "first, earliest deadline first; prompts that can no longer make it follow"
    )
    block_size: int = arg(16, "tokens per KV cache block (page)", aliases=("--page-size",))
    kv_cache_memory_gb: float = arg(2.0, "memory for the KV cache pool, GiB")
    kv_cache_memory_bytes: int | None = arg(
        None, "memory for the KV cache pool in bytes, e.g. 4G (overrides --kv-cache-memory-gb)", type=human_readable_int
    )
    num_kv_blocks: int | None = arg(
        None, "exact number of KV blocks (overrides --kv-cache-memory-gb)", aliases=("--num-gpu-blocks-override",)
    )
    enable_prefix_caching: bool = arg(
        True, "reuse the KV of full blocks shared with earlier requests (a SHA-256 hash chain over their tokens)",
        negative_aliases=("--disable-radix-cache",)
    )
    scheduling_policy: str = arg("fcfs", "order of admission and preemption", choices=SCHEDULING_POLICIES,
                                 aliases=("--schedule-policy",))
    enable_hierarchical_cache: bool = arg(
        False, "keep KV blocks on disk too (SGLang's HiCache flags): a prompt whose blocks the pool no longer "
        "holds loads them from there instead of recomputing them, across restarts too (needs prefix caching)"
    )
    hicache_storage_backend: str = arg("file", "where the disk tier keeps blocks: file = one file per block "
                                       "under --hicache-storage-dir", choices=HICACHE_STORAGE_BACKENDS)
    hicache_storage_dir: str | None = arg(
        None, "the disk tier's folder; each model's blocks go in a subfolder named by its fingerprint "
        "(default: $CHUNKSERVE_CACHE/hicache, or ~/.cache/chunkserve/hicache)"
    )
    hicache_storage_max_gb: float = arg(
        10.0, "most GiB of block files one model keeps in the disk tier; the least recently stored or loaded "
        "are deleted first"
    )
    hicache_write_policy: str = arg(
        "write_through", "when a block goes to disk: write_through = once its KV is computed; write_back = "
        "when the pool evicts it (and, at shutdown, every block the pool caches)", choices=HICACHE_WRITE_POLICIES
    )
    disaggregation_mode: str = arg(
        "null", "prefill/decode disaggregation (SGLang's flag): prefill = compute prompts and push their KV to a "
        "decode instance chunk by chunk; decode = receive the KV and decode; null = both here (monolithic). Both "
        "roles take requests from `chunkserve router --pd-disaggregation`", choices=DISAGGREGATION_MODES
    )
    disaggregation_transfer_backend: str = arg(
        "zmq", "how KV travels between the instances: zmq = pyzmq over TCP", choices=DISAGGREGATION_TRANSFER_BACKENDS
    )
    disaggregation_bootstrap_port: int = arg(
        8998, "a prefill instance's TCP port for decode instances' bootstrap and its KV transfers"
    )
    disaggregation_bootstrap_host: str = arg(
        "127.0.0.1", "the address a prefill instance's bootstrap port listens on (chunkserve serve sets it to "
        "--host)"
    )
    disaggregation_bootstrap_timeout: float = arg(
        300.0, "prefill: seconds a request waits for its decode instance to bootstrap (its blocks held) before it "
        "is failed and its blocks freed"
    )
    disaggregation_waiting_timeout: float = arg(
        300.0, "decode: seconds a request may wait for its KV (bootstrapping, pre-allocated or transferring) "
        "before it is aborted and its blocks freed"
    )
    disaggregation_heartbeat_interval: float = arg(
        1.0, "seconds between heartbeats on a decode instance's connection to each prefill instance"
    )
    disaggregation_heartbeat_max_failures: int = arg(
        3, "missed heartbeats after which a decode instance takes a prefill instance for dead and aborts the "
        "requests whose KV it was sending"
    )
    disaggregation_kv_lease_timeout: float = arg(
        30.0, "prefill: seconds a request's blocks stay held for a decode instance that stopped renewing its lease"
    )
    disaggregation_transfer_window: int = arg(
        64, "most KV blocks of one request in flight between the instances (credits the decode side grants as "
        "it copies blocks into its pool), so a long prompt's KV cannot pile up in socket buffers"
    )
    tensor_parallel_size: int = arg(
        1, "tensor-parallel ranks: each holds its share of every layer's heads and MLP columns (one all-reduce "
        "after the attention and one after the MLP of every layer)", aliases=("-tp", "--tp", "--tp-size")
    )
    pipeline_parallel_size: int = arg(
        1, "pipeline stages: each runs a consecutive share of the layers, up to this many steps in flight",
        aliases=("-pp", "--pp", "--pp-size")
    )
    pp_layer_partition: str | None = arg(
        None, "layers per pipeline stage, comma-separated, first stage first (e.g. 12,18; default: as even as "
        "possible)"
    )
    distributed_executor_backend: str | None = arg(
        None, "uni = the model in the engine's own process (one rank only); mp = one worker process per rank "
        "(default: uni for one rank, mp for more)", choices=EXECUTOR_BACKENDS
    )
    nnodes: int = arg(1, "machines the ranks are spread over (each runs tp x pp / nnodes of them)")
    node_rank: int = arg(0, "this machine's index among --nnodes; node 0 runs the engine, the others --headless")
    master_addr: str = arg(
        "127.0.0.1", "node 0's address: torch.distributed's store listens on --master-port there, the engine's "
        "control socket on --master-port + 1"
    )
    master_port: int = arg(29501, "node 0's torch.distributed store port (the control socket takes the next one)")
    op_backend: str = arg(
        "auto", "cpp = C++ ops (built on first use): decode attention reading the paged KV in place, the "
        "linear layers of small batches, fused norm/rotary/SiLU; torch = plain torch (the reference); auto = "
        "cpp where it builds", choices=OP_BACKENDS
    )
    cpu_omp_threads_bind: str | None = arg(
        None, "the CPUs of the engine's compute threads, as vLLM's VLLM_CPU_OMP_THREADS_BIND (read when this flag is "
        "not given): auto (the default) = one thread per CPU this process may use (its affinity, capped by its "
        "cgroup's CPU quota; shared by the ranks of this node), not pinned; nobind = OMP_NUM_THREADS or one per "
        "allowed CPU; CPU lists, one per rank of this node, e.g. 0-3 or 0-3|4-7 = one thread pinned to each CPU. "
        "OMP_NUM_THREADS, OMP_WAIT_POLICY and GOMP_SPINCOUNT given in the environment are kept"
    )
    speculative_config: str | dict | None = arg(
        None, "speculative decoding, as JSON (vLLM's shape): '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 5}', or '{\"method\": \"draft_model\", \"model\": PATH, "
        "\"num_speculative_tokens\": 4}'; \"policy\": \"auto\" (default: drafts only while they pay, by the "
        "step-time model) or \"always\""
    )
    structured_outputs_config: str | dict | None = arg(
        None, "structured outputs, as JSON (vLLM's shape): '{\"backend\": \"auto\"}' (auto, guidance and llguidance "
        "all select llguidance, the one backend here; xgrammar, outlines and lm-format-enforcer are refused), "
        "\"disable_any_whitespace\": true (compact JSON), \"disable_additional_properties\": true (a schema's "
        "objects take only the properties it names): defaults for every request"
    )
    seed: int = arg(0, "seed of the sampler for requests that give none", aliases=("--random-seed",))
    max_prompt_chars: int | None = arg(
        None, f"longer prompts are refused before they are tokenized (default: {CHARS_PER_TOKEN_BOUND} x max_model_len)"
    )
    max_stop_sequences: int = arg(64, "most stop strings one request may give")
    max_stop_sequence_chars: int = arg(1024, "longest stop string, in characters")
    max_stop_token_ids: int = arg(1024, "most stop token ids one request may give")
    max_logit_bias: int = arg(1024, "most logit_bias entries one request may give")

    def __post_init__(self) -> None:
        def fail(message: str) -> None:
            raise InvalidRequestError(message)

        self.dtype = auto_dtype() if self.dtype == "auto" else DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype in ("half", "float16"):
            fail(f"dtype {self.dtype} is not supported on CPU: use bfloat16 (the same memory) or float32")
        if self.dtype not in DTYPES:
            fail(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if self.op_backend not in OP_BACKENDS:
            fail(f"op_backend must be one of {OP_BACKENDS}, got {self.op_backend!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            fail(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        if self.hicache_storage_backend not in HICACHE_STORAGE_BACKENDS:
            fail(f"hicache_storage_backend must be one of {HICACHE_STORAGE_BACKENDS}, "
                 f"got {self.hicache_storage_backend!r}")
        if self.hicache_write_policy not in HICACHE_WRITE_POLICIES:
            fail(f"hicache_write_policy must be one of {HICACHE_WRITE_POLICIES}, got {self.hicache_write_policy!r}")
        if not self.hicache_storage_max_gb > 0:
            fail(f"hicache_storage_max_gb must be positive, got {self.hicache_storage_max_gb}")
        if self.hicache_storage_dir is not None and not self.hicache_storage_dir.strip():
            fail("hicache_storage_dir must not be empty (leave it out for the default folder)")
        if self.enable_hierarchical_cache and not self.enable_prefix_caching:
            fail("enable_hierarchical_cache needs enable_prefix_caching: the disk tier finds blocks by their "
                 "prefix-cache hash")
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            fail(f"disaggregation_mode must be one of {DISAGGREGATION_MODES}, got {self.disaggregation_mode!r}")
        if self.disaggregation_transfer_backend not in DISAGGREGATION_TRANSFER_BACKENDS:
            fail(f"disaggregation_transfer_backend must be one of {DISAGGREGATION_TRANSFER_BACKENDS}, "
                 f"got {self.disaggregation_transfer_backend!r}")
        if self.disaggregation_mode != "null" and self.enable_hierarchical_cache:
            fail("disaggregation_mode and enable_hierarchical_cache cannot be combined yet (one KV connector per "
                 "engine)")
        if not 1 <= self.disaggregation_bootstrap_port <= 65535:
            fail(f"disaggregation_bootstrap_port must be in [1, 65535], got {self.disaggregation_bootstrap_port}")
        for name in ("disaggregation_bootstrap_timeout", "disaggregation_waiting_timeout",
                     "disaggregation_heartbeat_interval", "disaggregation_kv_lease_timeout"):
            if not getattr(self, name) > 0:
                fail(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("disaggregation_heartbeat_max_failures", "disaggregation_transfer_window"):
            if getattr(self, name) < 1:
                fail(f"{name} must be at least 1, got {getattr(self, name)}")
        parallel = self.parallel_config()  # checks the parallel flags
        self.cpu_omp_threads_bind = threads_bind_setting(self.cpu_omp_threads_bind)
        bind = parse_threads_bind(self.cpu_omp_threads_bind)  # checks the syntax; the executor checks the CPUs
        if isinstance(bind, list) and len(bind) != len(parallel.local_ranks):
            fail(f"cpu_omp_threads_bind {self.cpu_omp_threads_bind!r} gives {len(bind)} CPU lists for the "
                 f"{len(parallel.local_ranks)} rank(s) of this node: give one list per rank, separated by |")
        if self.distributed_executor_backend not in (None, *EXECUTOR_BACKENDS):
            fail(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
                 f"got {self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "uni" and parallel.world_size > 1:
            fail(f"the uni executor runs one rank; tensor_parallel_size x pipeline_parallel_size is "
                 f"{parallel.world_size}: use --distributed-executor-backend mp")
        if parallel.world_size > 1 and (self.disaggregation_mode != "null" or self.enable_hierarchical_cache):
            fail("tensor/pipeline parallelism cannot be combined with disaggregation_mode or "
                 "enable_hierarchical_cache yet (their KV connectors move one rank's KV pool)")
        self.structured_outputs()  # checks the JSON
        speculative = self.speculative()  # checks the JSON
        if speculative is not None and parallel.pipeline_parallel_size > 1:
            fail("speculative decoding is not supported with pipeline parallelism (as in vLLM): a request's drafts "
                 "come from the tokens of its step still in flight; use --pipeline-parallel-size 1")
        if speculative is not None and speculative.drafts_in_worker and parallel.world_size > 1:
            fail('speculative_config method "draft_model" is not supported with tensor parallelism yet (the draft '
                 'model is not sharded); "ngram" is')
        if self.block_size < 1:
            fail(f"block_size must be positive, got {self.block_size}")
        if self.max_num_batched_tokens == -1:  # SGLang's --chunked-prefill-size -1
            fail("max_num_batched_tokens -1 (no chunking) is spelled --no-enable-chunked-prefill here")
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
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            fail(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            fail(f"max_logprobs must be in [0, {MAX_LOGPROBS}], got {self.max_logprobs}")
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(self.generation_config):
            fail(f"generation_config must be auto, vllm or a folder holding a generation_config.json; "
                 f"{self.generation_config!r} is not a folder")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            fail("num_kv_blocks must be positive")
        if self.max_model_len is not None and self.max_model_len < 1:
            fail("max_model_len must be positive")
        for name in ("max_prompt_chars", "max_stop_sequences", "max_stop_sequence_chars", "max_stop_token_ids",
                     "max_logit_bias"):
            value = getattr(self, name)
            if value is not None and value < 1:
                fail(f"{name} must be positive, got {value}")

    @property
    def kv_cache_bytes(self) -> int:
        """The KV pool's memory: --kv-cache-memory-bytes, else --kv-cache-memory-gb."""
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        return int(self.kv_cache_memory_gb * 2**30)

    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    def structured_outputs(self) -> StructuredOutputsConfig:
        return StructuredOutputsConfig.parse(self.structured_outputs_config)

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size, self.nnodes, self.node_rank,
                              self.master_addr, self.master_port, parse_layer_partition(self.pp_layer_partition))

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "mp" if self.parallel_config().world_size > 1 else "uni"

    @property
    def ranks_take_tokens_from_steps(self) -> bool:
        """Worker processes (mp) take every request's tokens from the steps: only one of them samples."""
        return self.executor_backend == "mp"

    def request_limits(self, max_model_len: int) -> RequestLimits:
        """The frontend's bounds on one request, with the default that depends on max_model_len resolved."""
        prompt_chars = self.max_prompt_chars or CHARS_PER_TOKEN_BOUND * max_model_len
        return RequestLimits(prompt_chars, self.max_stop_sequences, self.max_stop_sequence_chars,
                             self.max_stop_token_ids, self.max_logit_bias, self.max_logprobs)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's settings, with the defaults that depend on the model's length limit resolved."""
        budget = self.max_num_batched_tokens
        if budget is None:
            if not self.enable_chunked_prefill:
                budget = max(max_model_len, DEFAULT_CHUNKED_BUDGET)
            else:
                budget = DEFAULT_SLO_BUDGET if self.tbt_slo_ms is not None else DEFAULT_CHUNKED_BUDGET
        max_num_seqs = self.max_num_seqs if self.max_num_seqs is not None else min(DEFAULT_MAX_NUM_SEQS, budget)
        resolved = {"max_model_len", "max_num_batched_tokens", "max_num_seqs", "chunk_schedule", "max_steps_in_flight",
                    "send_token_ids", "speculative"}
        names = {f.name for f in dataclasses.fields(SchedulerConfig)} - resolved
        return SchedulerConfig(
            max_model_len=max_model_len,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            chunk_schedule=None if self.chunk_schedule is None else ChunkSchedule.parse(self.chunk_schedule),
            max_steps_in_flight=self.pipeline_parallel_size,
            send_token_ids=self.ranks_take_tokens_from_steps,
            speculative=self.speculative(),
            **{n: getattr(self, n) for n in names},
        )

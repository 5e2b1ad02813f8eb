"""The engine's configuration: one flat `EngineArgs` with vLLM's names, each field a flag, and
the typed leaves built from it (SchedulerConfig, CacheConfig, ParallelConfig, ...). A flag that
belongs to a leaf takes its default and help text from the leaf's field (`flag_of`), and each
leaf checks itself when built; `EngineArgs.__post_init__` builds the leaves it can before the
model is known and checks only the rules across them. `create_engine_config` builds the
resolved leaves once the model's length limit is known; the command line builds `EngineArgs`
from flags (entrypoints/args.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from chunkserve.config.cache import CacheConfig
from chunkserve.config.cpu import auto_dtype
from chunkserve.config.cpu_threads import parse_threads_bind, threads_bind_setting
from chunkserve.config.disaggregation import DisaggregationConfig
from chunkserve.config.fields import arg, flag_of, human_readable_int
from chunkserve.config.kv_connector import KVConnectorConfig
from chunkserve.config.kv_events import KVEventsConfig
from chunkserve.config.kv_tier import KVTierConfig
from chunkserve.config.limits import RequestLimits
from chunkserve.config.multimodal import MultiModalConfig
from chunkserve.config.parallel import ParallelConfig, parse_layer_partition
from chunkserve.config.scheduler import DEFAULT_MAX_NUM_SEQS, ChunkSchedule, SchedulerConfig
from chunkserve.config.speculative import SpeculativeConfig
from chunkserve.config.structured_outputs import StructuredOutputsConfig
from chunkserve.errors import InvalidRequestError

DTYPES = ("float32", "bfloat16")
# vLLM's spellings; float16 has no fast CPU kernels. auto is resolved for this CPU (config/cpu.py).
DTYPE_ALIASES = {"float": "float32"}
DTYPE_CHOICES = ("auto", *DTYPES, *DTYPE_ALIASES, "half", "float16")
OP_BACKENDS = ("auto", "cpp", "torch")
EXECUTOR_BACKENDS = ("uni", "mp")
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"  # vLLM's switch for its batch-invariant mode; read as --deterministic


@dataclass(frozen=True)
class EngineConfig:
    """The resolved leaves of one engine, built once (`EngineArgs.create_engine_config`)."""

    scheduler: SchedulerConfig
    cache: CacheConfig
    parallel: ParallelConfig
    kv_connector: KVConnectorConfig
    structured_outputs: StructuredOutputsConfig
    request_limits: RequestLimits
    kv_events: KVEventsConfig | None


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
    max_logprobs: int = flag_of(RequestLimits, "max_logprobs")
    max_num_batched_tokens: int | None = flag_of(SchedulerConfig, "max_num_batched_tokens", default=None)
    max_num_seqs: int | None = flag_of(SchedulerConfig, "max_num_seqs", default=None)
    enable_chunked_prefill: bool = flag_of(SchedulerConfig, "enable_chunked_prefill")
    enable_mixed_batch: bool = flag_of(SchedulerConfig, "enable_mixed_batch")
    long_prefill_token_threshold: int = flag_of(SchedulerConfig, "long_prefill_token_threshold")
    max_num_partial_prefills: int = flag_of(SchedulerConfig, "max_num_partial_prefills")
    max_long_partial_prefills: int = flag_of(SchedulerConfig, "max_long_partial_prefills")
    chunk_align: int | None = flag_of(SchedulerConfig, "chunk_align")
    chunk_schedule: str | None = flag_of(SchedulerConfig, "chunk_schedule")
    tbt_slo_ms: float | None = flag_of(SchedulerConfig, "tbt_slo_ms")
    max_prefill_wait_ms: float = flag_of(SchedulerConfig, "max_prefill_wait_ms")
    ttft_slo_ms: float | None = flag_of(SchedulerConfig, "ttft_slo_ms")
    max_num_batched_encoder_embeds: int | None = flag_of(SchedulerConfig, "max_num_batched_encoder_embeds")
    encoder_cache_size: int | None = flag_of(SchedulerConfig, "encoder_cache_size")
    disable_chunked_mm_input: bool = flag_of(SchedulerConfig, "disable_chunked_mm_input")
    block_size: int = flag_of(CacheConfig, "block_size")
    kv_cache_memory_gb: float = flag_of(CacheConfig, "kv_cache_memory_gb")
    kv_cache_memory_bytes: int | None = flag_of(CacheConfig, "kv_cache_memory_bytes")
    num_kv_blocks: int | None = flag_of(CacheConfig, "num_kv_blocks")
    enable_prefix_caching: bool = flag_of(CacheConfig, "enable_prefix_caching")
    scheduling_policy: str = flag_of(SchedulerConfig, "scheduling_policy")
    enable_hierarchical_cache: bool = flag_of(KVTierConfig, "enable_hierarchical_cache")
    hicache_storage_backend: str = flag_of(KVTierConfig, "hicache_storage_backend")
    hicache_storage_dir: str | None = flag_of(KVTierConfig, "hicache_storage_dir")
    hicache_storage_max_gb: float = flag_of(KVTierConfig, "hicache_storage_max_gb")
    hicache_write_policy: str = flag_of(KVTierConfig, "hicache_write_policy")
    disaggregation_mode: str = flag_of(DisaggregationConfig, "disaggregation_mode")
    disaggregation_transfer_backend: str = flag_of(DisaggregationConfig, "disaggregation_transfer_backend")
    disaggregation_bootstrap_port: int = flag_of(DisaggregationConfig, "disaggregation_bootstrap_port")
    disaggregation_bootstrap_host: str = flag_of(DisaggregationConfig, "disaggregation_bootstrap_host")
    disaggregation_bootstrap_timeout: float = flag_of(DisaggregationConfig, "disaggregation_bootstrap_timeout")
    disaggregation_waiting_timeout: float = flag_of(DisaggregationConfig, "disaggregation_waiting_timeout")
    disaggregation_heartbeat_interval: float = flag_of(DisaggregationConfig, "disaggregation_heartbeat_interval")
    disaggregation_heartbeat_max_failures: int = flag_of(DisaggregationConfig, "disaggregation_heartbeat_max_failures")
    disaggregation_kv_lease_timeout: float = flag_of(DisaggregationConfig, "disaggregation_kv_lease_timeout")
    disaggregation_transfer_window: int = flag_of(DisaggregationConfig, "disaggregation_transfer_window")
    tensor_parallel_size: int = flag_of(ParallelConfig, "tensor_parallel_size")
    pipeline_parallel_size: int = flag_of(ParallelConfig, "pipeline_parallel_size")
    pp_layer_partition: str | None = flag_of(ParallelConfig, "pp_layer_partition")
    distributed_executor_backend: str | None = arg(
        None, "uni = the model in the engine's own process (one rank only); mp = one worker process per rank "
        "(default: uni for one rank, mp for more)", choices=EXECUTOR_BACKENDS
    )
    nnodes: int = flag_of(ParallelConfig, "nnodes")
    node_rank: int = flag_of(ParallelConfig, "node_rank")
    master_addr: str = flag_of(ParallelConfig, "master_addr")
    master_port: int = flag_of(ParallelConfig, "master_port")
    op_backend: str = arg(
        "auto", "cpp = C++ ops (built on first use): decode attention reading the paged KV in place, the "
        "linear layers of small batches, fused norm/rotary/SiLU; torch = plain torch (the reference); auto = "
        "cpp where it builds", choices=OP_BACKENDS
    )
    deterministic: bool = arg(
        False, "deterministic inference: for a given model, dtype and parallel configuration, every request's logits "
        "are bit-identical whatever else is in its batch, however its prompt is chunked, whether its prefix came from "
        "the cache, whether it was preempted and recomputed or verified speculatively, and in whatever order requests "
        "arrive; sampled requests draw by Gumbel-max over a hash of (seed, position, token), so a seeded request's "
        "tokens depend only on its seed (unseeded: --seed and the request id). Holds within one tensor-parallel size "
        f"and one CPU kind. Also turned on by {BATCH_INVARIANT_ENV}=1 in the environment (vLLM's switch). Needs the "
        "C++ ops (--op-backend torch is refused) and no --int8-activations",
        aliases=("--enable-deterministic-inference",)
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
    kv_events_config: str | dict | None = arg(
        None, "publish what the prefix cache holds for KV-aware routers (Dynamo, llm-d, SGLang's gateway), as JSON "
        "(vLLM's shape and wire format): '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": "
        "\"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"\"}' (also buffer_steps, hwm, "
        "max_queue_size); docs/FLEET.md"
    )
    seed: int = arg(0, "seed of the sampler for requests that give none", aliases=("--random-seed",))
    max_prompt_chars: int | None = flag_of(RequestLimits, "max_prompt_chars", default=None)
    max_stop_sequences: int = flag_of(RequestLimits, "max_stop_sequences")
    max_stop_sequence_chars: int = flag_of(RequestLimits, "max_stop_sequence_chars")
    max_stop_token_ids: int = flag_of(RequestLimits, "max_stop_token_ids")
    max_logit_bias: int = flag_of(RequestLimits, "max_logit_bias")
    limit_mm_per_prompt: str | dict | None = flag_of(MultiModalConfig, "limit_mm_per_prompt")
    allowed_local_media_path: str = flag_of(MultiModalConfig, "allowed_local_media_path")
    allowed_media_domains: list[str] | None = flag_of(MultiModalConfig, "allowed_media_domains")
    max_image_bytes: int = flag_of(MultiModalConfig, "max_image_bytes")
    max_image_pixels: int = flag_of(MultiModalConfig, "max_image_pixels")

    def __post_init__(self) -> None:
        """Builds (and so checks) every leaf the flags give before the model is known; the rules
        across leaves are checked here."""
        self.dtype = auto_dtype() if self.dtype == "auto" else DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype in ("half", "float16"):
            _fail(f"dtype {self.dtype} is not supported on CPU: use bfloat16 (the same memory) or float32")
        if self.dtype not in DTYPES:
            _fail(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if self.op_backend not in OP_BACKENDS:
            _fail(f"op_backend must be one of {OP_BACKENDS}, got {self.op_backend!r}")
        self._check_deterministic()
        cache, connectors = self.cache_config(), self.kv_connector_config()
        if connectors.kv_tier.enable_hierarchical_cache and not cache.enable_prefix_caching:
            _fail("enable_hierarchical_cache needs enable_prefix_caching: the disk tier finds blocks by their "
                  "prefix-cache hash")
        parallel = self.parallel_config()
        self._check_executor(parallel)
        if parallel.world_size > 1 and connectors.connector is not None:
            _fail("tensor/pipeline parallelism cannot be combined with disaggregation_mode or "
                  "enable_hierarchical_cache yet (their KV connectors move one rank's KV pool)")
        self.structured_outputs()
        self.multimodal_config()
        kv_events = self.kv_events()
        if kv_events is not None and kv_events.publishes and not cache.enable_prefix_caching:
            _fail("kv_events_config needs enable_prefix_caching: the events name blocks by their prefix-cache hash")
        speculative = self.speculative()
        if speculative is not None and parallel.pipeline_parallel_size > 1:
            _fail("speculative decoding is not supported with pipeline parallelism (as in vLLM): a request's drafts "
                  "come from the tokens of its step still in flight; use --pipeline-parallel-size 1")
        if speculative is not None and speculative.drafts_in_worker and parallel.world_size > 1:
            _fail('speculative_config method "draft_model" is not supported with tensor parallelism yet (the draft '
                  'model is not sharded); "ngram" is')
        if self.max_model_len is not None and self.max_model_len < 1:
            _fail("max_model_len must be positive")
        # the rules that need the model's length limit are checked again once it is known
        self.scheduler_config(self.max_model_len or 1)
        self.request_limits(self.max_model_len or 1)
        if self.generation_config not in ("auto", "vllm") and not os.path.isdir(self.generation_config):
            _fail(f"generation_config must be auto, vllm or a folder holding a generation_config.json; "
                  f"{self.generation_config!r} is not a folder")

    def _check_deterministic(self) -> None:
        """Turns the mode on where vLLM's environment switch asks for it, and refuses the flags
        whose kernels give a row different bits in different batches."""
        self.deterministic = self.deterministic or _batch_invariant_env()
        if not self.deterministic:
            return
        if self.op_backend == "torch":
            _fail("--deterministic needs the C++ ops: --op-backend torch multiplies with MKL, whose GEMM blocking "
                  "depends on the row count, so a row's bits depend on its batch; use --op-backend auto or cpp")
        if self.int8_activations:
            _fail("--deterministic cannot be combined with --int8-activations yet (8-bit activations serve only "
                  "steps of a few rows, so a row's numerics depend on its batch): leave one of the two off")

    def _check_executor(self, parallel: ParallelConfig) -> None:
        """The executor's flags against the ranks: one CPU list per local rank, uni runs one."""
        self.cpu_omp_threads_bind = threads_bind_setting(self.cpu_omp_threads_bind)
        bind = parse_threads_bind(self.cpu_omp_threads_bind)  # checks the syntax; the executor checks the CPUs
        if isinstance(bind, list) and len(bind) != len(parallel.local_ranks):
            _fail(f"cpu_omp_threads_bind {self.cpu_omp_threads_bind!r} gives {len(bind)} CPU lists for the "
                  f"{len(parallel.local_ranks)} rank(s) of this node: give one list per rank, separated by |")
        if self.distributed_executor_backend not in (None, *EXECUTOR_BACKENDS):
            _fail(f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, "
                  f"got {self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "uni" and parallel.world_size > 1:
            _fail(f"the uni executor runs one rank; tensor_parallel_size x pipeline_parallel_size is "
                  f"{parallel.world_size}: use --distributed-executor-backend mp")

    @property
    def kv_cache_bytes(self) -> int:
        """The KV pool's memory: --kv-cache-memory-bytes, else --kv-cache-memory-gb."""
        return self.cache_config().kv_cache_bytes

    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

    def kv_events(self) -> KVEventsConfig | None:
        return KVEventsConfig.parse(self.kv_events_config)

    def structured_outputs(self) -> StructuredOutputsConfig:
        return StructuredOutputsConfig.parse(self.structured_outputs_config)

    def multimodal_config(self) -> MultiModalConfig:
        return MultiModalConfig(
            limit_mm_per_prompt=self.limit_mm_per_prompt,
            allowed_local_media_path=self.allowed_local_media_path,
            allowed_media_domains=self.allowed_media_domains,
            max_image_bytes=self.max_image_bytes,
            max_image_pixels=self.max_image_pixels,
        )

    def cache_config(self) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            kv_cache_memory_gb=self.kv_cache_memory_gb,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            num_kv_blocks=self.num_kv_blocks,
            enable_prefix_caching=self.enable_prefix_caching,
        )

    def kv_connector_config(self) -> KVConnectorConfig:
        kv_tier = KVTierConfig(
            enable_hierarchical_cache=self.enable_hierarchical_cache,
            hicache_storage_backend=self.hicache_storage_backend,
            hicache_storage_dir=self.hicache_storage_dir,
            hicache_storage_max_gb=self.hicache_storage_max_gb,
            hicache_write_policy=self.hicache_write_policy,
        )
        disaggregation = DisaggregationConfig(
            disaggregation_mode=self.disaggregation_mode,
            disaggregation_transfer_backend=self.disaggregation_transfer_backend,
            disaggregation_bootstrap_port=self.disaggregation_bootstrap_port,
            disaggregation_bootstrap_host=self.disaggregation_bootstrap_host,
            disaggregation_bootstrap_timeout=self.disaggregation_bootstrap_timeout,
            disaggregation_waiting_timeout=self.disaggregation_waiting_timeout,
            disaggregation_heartbeat_interval=self.disaggregation_heartbeat_interval,
            disaggregation_heartbeat_max_failures=self.disaggregation_heartbeat_max_failures,
            disaggregation_kv_lease_timeout=self.disaggregation_kv_lease_timeout,
            disaggregation_transfer_window=self.disaggregation_transfer_window,
        )
        return KVConnectorConfig(block_size=self.block_size, kv_tier=kv_tier, disaggregation=disaggregation)

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            nnodes=self.nnodes,
            node_rank=self.node_rank,
            master_addr=self.master_addr,
            master_port=self.master_port,
            pp_layer_partition=parse_layer_partition(self.pp_layer_partition),
        )

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "mp" if self.parallel_config().world_size > 1 else "uni"

    @property
    def tokens_from_steps(self) -> bool:
        """Worker processes (mp) take every request's tokens from the steps: only one of them samples."""
        return self.executor_backend == "mp"

    def request_limits(self, max_model_len: int) -> RequestLimits:
        """The frontend's bounds on one request, with the default that depends on max_model_len resolved."""
        return RequestLimits(
            max_prompt_chars=RequestLimits.default_prompt_chars(max_model_len) if self.max_prompt_chars is None
            else self.max_prompt_chars,
            max_stop_sequences=self.max_stop_sequences,
            max_stop_sequence_chars=self.max_stop_sequence_chars,
            max_stop_token_ids=self.max_stop_token_ids,
            max_logit_bias=self.max_logit_bias,
            max_logprobs=self.max_logprobs,
        )

    def scheduler_config(self, max_model_len: int, max_tokens_per_mm_item: int | None = None) -> SchedulerConfig:
        """The scheduler's settings, with the defaults that depend on the model resolved: its length
        limit and, for a multimodal model, its most placeholder tokens per item."""
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = SchedulerConfig.default_budget(max_model_len, self.enable_chunked_prefill, self.tbt_slo_ms)
        return SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=self.max_num_seqs if self.max_num_seqs is not None else min(DEFAULT_MAX_NUM_SEQS, budget),
            max_model_len=max_model_len,
            block_size=self.block_size,
            enable_chunked_prefill=self.enable_chunked_prefill,
            enable_mixed_batch=self.enable_mixed_batch,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_num_partial_prefills=self.max_num_partial_prefills,
            max_long_partial_prefills=self.max_long_partial_prefills,
            enable_prefix_caching=self.enable_prefix_caching,
            scheduling_policy=self.scheduling_policy,
            chunk_align=self.chunk_align,
            chunk_schedule=None if self.chunk_schedule is None else ChunkSchedule.parse(self.chunk_schedule),
            tbt_slo_ms=self.tbt_slo_ms,
            max_prefill_wait_ms=self.max_prefill_wait_ms,
            ttft_slo_ms=self.ttft_slo_ms,
            max_steps_in_flight=self.parallel_config().max_steps_in_flight,
            tokens_from_steps=self.tokens_from_steps,
            speculative=self.speculative(),
            enable_kv_cache_events=(kv_events := self.kv_events()) is not None and kv_events.publishes,
            max_num_batched_encoder_embeds=self.max_num_batched_encoder_embeds,
            encoder_cache_size=self.encoder_cache_size,
            disable_chunked_mm_input=self.disable_chunked_mm_input,
            max_tokens_per_mm_item=max_tokens_per_mm_item,
        )

    def create_engine_config(self, max_model_len: int, max_tokens_per_mm_item: int | None = None) -> EngineConfig:
        """Every resolved leaf, once the model is known (each checks itself): its length limit and,
        multimodal, its most placeholder tokens per item."""
        return EngineConfig(
            scheduler=self.scheduler_config(max_model_len, max_tokens_per_mm_item),
            cache=self.cache_config(),
            parallel=self.parallel_config(),
            kv_connector=self.kv_connector_config(),
            structured_outputs=self.structured_outputs(),
            request_limits=self.request_limits(max_model_len),
            kv_events=self.kv_events(),
        )


def _batch_invariant_env() -> bool:
    """vLLM's VLLM_BATCH_INVARIANT: an integer, nonzero for on (unset: off)."""
    value = os.environ.get(BATCH_INVARIANT_ENV, "0").strip() or "0"
    try:
        return int(value) != 0
    except ValueError:
        _fail(f"{BATCH_INVARIANT_ENV} must be 0 or 1 (it turns on --deterministic), got {value!r}")


def _fail(message: str) -> None:
    raise InvalidRequestError(message)

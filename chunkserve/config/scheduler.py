"""The scheduler's configuration: token budget, chunking, SLOs, admission and preemption
policies, and Sarathi-Serve's decreasing chunk schedule (a value type the scheduler reads).
The budget rules live here, so a SchedulerConfig built directly (a library user, a test) is
checked as the engine's is."""

from __future__ import annotations

from dataclasses import dataclass

from chunkserve.config.cache import CacheConfig
from chunkserve.config.fields import REQUIRED, arg, flag_of, human_readable_int
from chunkserve.config.speculative import SpeculativeConfig
from chunkserve.errors import InvalidRequestError

SCHEDULING_POLICIES = ("fcfs", "priority")
DEFAULT_CHUNKED_BUDGET = 512
DEFAULT_SLO_BUDGET = 2048  # with --tbt-slo-ms the SLO sizes steps; the budget is only a ceiling
DEFAULT_MAX_NUM_SEQS = 128


@dataclass(frozen=True)
class ChunkSchedule:
    high: int
    low: int
    stages: int
    max_tokens: int

    def __post_init__(self) -> None:
        if not 0 < self.low <= self.high:
            raise InvalidRequestError(f"chunk schedule needs 0 < low <= high, got low {self.low}, high {self.high}")
        if self.stages < 1 or self.max_tokens < self.stages:
            raise InvalidRequestError(
                f"chunk schedule needs stages >= 1 and max_tokens >= stages, got {self.stages} stages "
                f"over {self.max_tokens} tokens"
            )

    @classmethod
    def parse(cls, spec: str) -> ChunkSchedule:
        """'high:low:stages:max_tokens', e.g. '512:128:4:4096'."""
        parts = spec.split(":")
        if len(parts) != 4 or not all(p.strip().isdigit() for p in parts):
            raise InvalidRequestError(
                f"chunk schedule must be 'high:low:stages:max_tokens' (four integers), got {spec!r}"
            )
        high, low, stages, max_tokens = (int(p) for p in parts)
        return cls(high, low, stages, max_tokens)

    @property
    def tokens_per_stage(self) -> int:
        return -(-self.max_tokens // self.stages)

    def step_tokens(self, num_prefilled: int) -> int:
        """The most tokens a step may hold when it carries a chunk of a prompt whose first
        `num_prefilled` tokens are already computed."""
        stage = min(num_prefilled // self.tokens_per_stage, self.stages - 1)
        if self.stages == 1:
            return self.high
        return round(self.high - (self.high - self.low) * stage / (self.stages - 1))


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler reads, resolved (EngineArgs.scheduler_config): each flag's default and
    help text are here, and a config that could not schedule is refused when it is built."""

    max_num_batched_tokens: int = arg(
        REQUIRED,
        f"token budget of one engine step, decode + prefill tokens (default: {DEFAULT_CHUNKED_BUDGET} with "
        f"chunked prefill, {DEFAULT_SLO_BUDGET} with --tbt-slo-ms, max_model_len without chunking)",
        aliases=("--chunked-prefill-size",), type=human_readable_int
    )
    max_num_seqs: int = arg(
        REQUIRED, f"most requests running at once (default: {DEFAULT_MAX_NUM_SEQS}, at most the step budget)",
        aliases=("--max-running-requests",)
    )
    max_model_len: int
    block_size: int  # CacheConfig's
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
    enable_prefix_caching: bool = flag_of(CacheConfig, "enable_prefix_caching")
    scheduling_policy: str = arg("fcfs", "order of admission and preemption", choices=SCHEDULING_POLICIES,
                                 aliases=("--schedule-policy",))
    chunk_align: int | None = arg(
        None, "a prompt chunk that does not finish its prompt is a multiple of this many tokens, and where "
        "possible so is the step (decodes + chunks); a multiple of block_size (default: block_size)"
    )
    chunk_schedule: ChunkSchedule | None = arg(
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
    # pipeline parallelism (ParallelConfig.max_steps_in_flight): up to this many steps in flight; a request's
    # computed count advances when it is scheduled, and a request waiting for a sampled token is not scheduled
    # again until it comes back
    max_steps_in_flight: int = 1
    # the workers take every request's tokens from the steps (ScheduledRequest.new_token_ids) instead of
    # keeping what they sampled: with several ranks, only one samples
    tokens_from_steps: bool = False
    speculative: SpeculativeConfig | None = None
    # the KV cache manager logs what the prefix cache gains and loses, for the engine to publish (KV events)
    enable_kv_cache_events: bool = False
    max_num_batched_encoder_embeds: int | None = arg(
        None, "most encoder output rows (image embeddings) the vision encoder computes in one step (default: "
        "max_num_batched_tokens; never below the model's largest item)", type=human_readable_int
    )
    encoder_cache_size: int | None = arg(
        None, "encoder output rows the encoder cache holds, for images whose rows are not in the KV cache yet "
        "and for reuse by content (default: max_num_batched_tokens; never below the model's largest item)",
        type=human_readable_int
    )
    disable_chunked_mm_input: bool = arg(
        False, "schedule each image's placeholder range whole in one step or not at all (a prompt chunk never "
        "ends inside an image)"
    )
    # the model's most placeholder tokens per multimodal item, set by the engine from the model; None: a text
    # model (nothing multimodal applies)
    max_tokens_per_mm_item: int | None = None

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            _fail(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        self._check_budget()
        self._check_chunking()
        for name in ("tbt_slo_ms", "ttft_slo_ms"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                _fail(f"{name} must be positive, got {value}")
        if self.max_prefill_wait_ms < 0:
            _fail(f"max_prefill_wait_ms must be non-negative, got {self.max_prefill_wait_ms}")
        self._check_multimodal()

    def _check_budget(self) -> None:
        """A step holds every running decode and, without chunking, a whole prompt; chunks are whole blocks."""
        if self.max_num_batched_tokens == -1:  # SGLang's --chunked-prefill-size -1
            _fail("max_num_batched_tokens -1 (no chunking) is spelled --no-enable-chunked-prefill here")
        if self.max_num_batched_tokens < self.block_size:
            _fail(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                  f"block_size ({self.block_size}): chunks are whole blocks")
        if self.max_num_seqs < 1:
            _fail(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            _fail(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least max_num_seqs "
                  f"({self.max_num_seqs}), so every running decode fits in a step")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            _fail(f"with chunked prefill off a whole prompt must fit one step: max_num_batched_tokens "
                  f"({self.max_num_batched_tokens}) must be at least max_model_len ({self.max_model_len})")

    def _check_chunking(self) -> None:
        if self.long_prefill_token_threshold < 0:
            _fail("long_prefill_token_threshold must be non-negative")
        if 0 < self.long_prefill_token_threshold < self.block_size:
            _fail(f"long_prefill_token_threshold must be 0 or at least block_size ({self.block_size})")
        if self.max_num_partial_prefills < 1:
            _fail("max_num_partial_prefills must be at least 1")
        if not 1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills:
            _fail(f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be at least 1 and at most "
                  f"max_num_partial_prefills ({self.max_num_partial_prefills})")
        if self.chunk_align is not None and (self.chunk_align < 1 or self.chunk_align % self.block_size):
            _fail(f"chunk_align must be a positive multiple of block_size ({self.block_size}), got {self.chunk_align}")

    def _check_multimodal(self) -> None:
        for name in ("max_num_batched_encoder_embeds", "encoder_cache_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                _fail(f"{name} must be positive, got {value}")
        item = self.max_tokens_per_mm_item
        if self.disable_chunked_mm_input and item is not None and item > self.max_num_batched_tokens:
            _fail(f"Chunked MM input disabled but max_tokens_per_mm_item ({item}) is larger than "
                  f"max_num_batched_tokens ({self.max_num_batched_tokens}). Please increase max_num_batched_tokens.")

    @property
    def encoder_compute_budget(self) -> int:
        """Encoder output rows one step may compute: the flag or the token budget, floored at the
        model's largest item so that every item can run (vLLM's compute_mm_encoder_budget)."""
        return max(self.max_num_batched_encoder_embeds or self.max_num_batched_tokens,
                   self.max_tokens_per_mm_item or 0)

    @property
    def encoder_cache_capacity(self) -> int:
        """Encoder output rows the encoder cache holds, floored as `encoder_compute_budget`."""
        return max(self.encoder_cache_size or self.max_num_batched_tokens, self.max_tokens_per_mm_item or 0)

    @property
    def chunk_alignment(self) -> int:
        return self.chunk_align or self.block_size

    @staticmethod
    def default_budget(max_model_len: int, enable_chunked_prefill: bool, tbt_slo_ms: float | None) -> int:
        """max_num_batched_tokens when the flag leaves it out: a whole prompt without chunking;
        under a TBT SLO the SLO sizes the steps, so the budget is only a ceiling."""
        if not enable_chunked_prefill:
            return max(max_model_len, DEFAULT_CHUNKED_BUDGET)
        return DEFAULT_SLO_BUDGET if tbt_slo_ms is not None else DEFAULT_CHUNKED_BUDGET


def _fail(message: str) -> None:
    raise InvalidRequestError(message)

"""The scheduler's configuration: token budget, chunking, SLOs, admission and preemption
policies, and Sarathi-Serve's decreasing chunk schedule (a value type the scheduler reads)."""

from __future__ import annotations

from dataclasses import dataclass

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
    # pipeline parallelism: up to this many steps in flight; a request's computed count advances when it is
    # scheduled, and a request waiting for a sampled token is not scheduled again until it comes back
    max_steps_in_flight: int = 1
    # the workers take every request's tokens from the steps (ScheduledRequest.new_token_ids) instead of
    # keeping what they sampled: with several ranks, only one samples
    send_token_ids: bool = False
    speculative: SpeculativeConfig | None = None

    @property
    def chunk_alignment(self) -> int:
        return self.chunk_align or self.block_size

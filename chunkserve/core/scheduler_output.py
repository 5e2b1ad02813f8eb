"""The messages between the scheduler and the model runner. Plain data, no torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from chunkserve.sampling_params import SamplingParams


class ForwardMode(str, enum.Enum):
    """What a step computed: only prompt tokens, only decodes, or both in one forward."""

    EXTEND = "EXTEND"
    DECODE = "DECODE"
    MIXED = "MIXED"
    IDLE = "IDLE"


@dataclass
class NewRequestData:
    """Sent the first time a request is scheduled. The runner keeps the request's state
    (token history, sampler generator) until it finishes: a preempted request keeps it, only
    its KV is dropped, so a seeded sample stream continues where it was."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None


@dataclass
class ScheduledRequest:
    """One request's share of a step."""

    request_id: str
    num_computed_tokens: int  # tokens already in the KV cache: the first position computed now
    num_scheduled_tokens: int  # tokens computed in this step
    block_table: list[int]  # the request's block ids, covering all computed + scheduled tokens
    sample: bool  # True when this step completes all known tokens, so the last row is sampled
    is_decode: bool  # a single token after a finished prompt (stats only)


@dataclass
class SchedulerOutput:
    """Everything the runner needs for one step. `scheduled` lists decodes first."""

    scheduled: list[ScheduledRequest]
    new_requests: list[NewRequestData]
    finished_request_ids: set[str] = field(default_factory=set)  # runner drops their state
    preempted_request_ids: set[str] = field(default_factory=set)
    prefix_cache_queries: int = 0  # prompt tokens of the requests admitted for the first time in this step
    prefix_cache_hits: int = 0  # of those, found in the prefix cache (not computed)
    predicted_duration_s: float | None = None  # by the step-time model, None before it has data
    prefill_wait_guard: bool = False  # a prompt got tokens past the TBT SLO: it had waited too long

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.scheduled)

    @property
    def num_decode_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.scheduled if r.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_scheduled_tokens - self.num_decode_tokens

    @property
    def forward_mode(self) -> ForwardMode:
        prefill, decode = self.num_prefill_tokens > 0, self.num_decode_tokens > 0
        if prefill and decode:
            return ForwardMode.MIXED
        if prefill:
            return ForwardMode.EXTEND
        return ForwardMode.DECODE if decode else ForwardMode.IDLE

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class TokenLogprobs:
    """The log-probability of a sampled token and the `num_top` most likely alternatives,
    from the model's raw distribution (before penalties, temperature and filters)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class ModelRunnerOutput:
    """What the runner sampled: one token per request whose `sample` flag was set, and
    its logprobs for the requests that asked for them."""

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)


def hit_rate(hits: int, queries: int) -> float:
    """hits / queries, 0.0 before any query."""
    return hits / queries if queries else 0.0


@dataclass(frozen=True)
class SchedulerStats:
    """The scheduler's queues and KV pool at one moment (what /metrics shows as gauges)."""

    num_running: int
    num_waiting: int
    num_preempted_waiting: int  # waiting to be recomputed after a preemption
    num_free_blocks: int
    num_blocks: int
    num_preemptions_total: int
    prefix_cache_queries_total: int  # prompt tokens of admitted requests (first admissions, not recomputes)
    prefix_cache_hits_total: int  # of those, found there

    @property
    def prefix_cache_hit_rate(self) -> float:
        return hit_rate(self.prefix_cache_hits_total, self.prefix_cache_queries_total)

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

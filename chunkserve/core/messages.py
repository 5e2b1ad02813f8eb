"""The engine core's per-step messages: to the workers (`SchedulerOutput`, block tables as
diffs), from them (`ModelRunnerOutput`), and to the frontend (`EngineCoreOutput`, only what
is new; engine/messages.py's `EngineCoreOutputs` carries a step's worth of them, with the
step's record and stats). Plain data (numpy arrays at most), no torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from chunkserve.core.multimodal import MultiModalFeature
from chunkserve.core.stats import RankStepStats
from chunkserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from chunkserve.core.request import Request


class ForwardMode(str, enum.Enum):
    """What a step computed: only prompt tokens, only decodes, or both in one forward."""

    EXTEND = "EXTEND"
    DECODE = "DECODE"
    MIXED = "MIXED"
    IDLE = "IDLE"


@dataclass
class NewRequestData:
    """Sent the first time a request is scheduled. The worker keeps the request's state
    (token history, block table, sampler generator) until it finishes: a preempted request
    keeps it, only its KV is dropped, so a seeded sample stream continues where it was."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    output_token_ids: list[int] = field(default_factory=list)  # an imported request's output so far
    generator_state: bytes | None = None  # an imported seeded request's generator, where it stopped
    mm_features: list[MultiModalFeature] = field(default_factory=list)  # its images (the encoder's inputs)


@dataclass
class ScheduledRequest:
    """One request's share of a step. Its block table travels as a diff: the blocks added
    since the worker last saw it (all of them the first time, or after a preemption, when
    `resets_block_table` is set)."""

    request_id: str
    num_computed_tokens: int  # tokens already in the KV cache: the first position computed now
    num_scheduled_tokens: int  # tokens computed in this step (a decode's drafts included)
    new_block_ids: list[int]  # appended to the worker's block table of the request
    resets_block_table: bool  # the table starts anew with `new_block_ids` (new or resumed request)
    sample: bool  # True when this step completes all known tokens, so its last row(s) are sampled
    is_decode: bool  # the request's prompt is done: its last sampled token (and any drafts)
    draft_token_ids: list[int] = field(default_factory=list)  # drafts after the last token, to verify
    num_draft_proposals: int = 0  # with a draft model: drafts it proposes after this step, for the next one
    # with SchedulerConfig.tokens_from_steps: the request's tokens from position `token_ids_from` on that the
    # workers may lack (its latest sampled tokens); a worker that has them already overwrites them
    new_token_ids: list[int] = field(default_factory=list)
    token_ids_from: int = 0
    # structured outputs: int32 [num_sampled_rows, words], the tokens each sampling row allows (bit t of word
    # t // 32); None: no grammar
    grammar_bitmask: np.ndarray | None = None
    # images: indices into the request's mm_features whose encoder runs in this step (before the forward); the
    # step's rows in their ranges take slices of the encoder cache's output
    encoder_inputs: list[int] = field(default_factory=list)

    @property
    def num_sampled_rows(self) -> int:
        """Rows whose logits are sampled: the last, and one per draft before it."""
        return 1 + len(self.draft_token_ids) if self.sample else 0


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
    kv_connector_metadata: object = None  # what the KV connector's worker side loads or saves this step
    grammar_mask_s: float = 0.0  # seconds the scheduler spent filling grammar bitmasks for this step
    # encoder outputs (by identifier) the worker drops, before it runs this step's encoder inputs (an output
    # evicted and encoded again in one step is the new one)
    free_encoder_ids: list[str] = field(default_factory=list)
    num_encoder_inputs: int = 0  # images encoded in this step (the scheduled requests' encoder_inputs)
    num_encoder_embeds: int = 0  # their encoder output rows
    encoder_cache_hits: int = 0  # images a request found in the encoder cache in this step (not encoded again)

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
    # the token's rank in the whole vocabulary, 1 = most likely (vLLM's: tokens at least as likely count)
    rank: int | None = None


@dataclass
class ModelRunnerOutput:
    """What a step produced, per request whose `sample` flag was set: the tokens it accepts
    (its sampled token, after any accepted drafts: 1 + accepted drafts, in order), their
    logprobs for the requests that asked for them, the prompt's logprobs for those that asked
    (with their first token: one per prompt token, None for the first), and draft tokens
    proposed for its next step. `finished_sending` / `finished_recving`: requests whose KV
    the connector has finished sending (their blocks may be freed) or receiving (they may
    run)."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    # blocks the connector failed to load (vLLM's name): their requests recompute from the first one
    invalid_block_ids: set[int] = field(default_factory=set)
    kv_connector_output: object = None  # the connector's worker side to its scheduler side (its own type)
    rank_stats: list[RankStepStats] = field(default_factory=list)  # several ranks: each one's compute and comms
    num_encoder_calls: int = 0  # images the vision encoder encoded in this step
    encoder_seconds: float = 0.0  # the vision encoder's time in this step


class EngineCoreOutput(NamedTuple):
    """What one request got from one step, as the engine core reports it: only what is new,
    so a step's message does not grow with the requests' histories. A NamedTuple pickles as
    a plain tuple (its class once per message). A step's outputs travel to the frontend
    together, in engine/messages.py's `EngineCoreOutputs`."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None  # one per new token, when the request asked for logprobs
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    stop_reason: int | str | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0  # prompt tokens read from the prefix cache at first admission
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # wall clock of the step that first scheduled it
    error: str | None = None  # set when the engine failed the request (finish_reason "abort"): why
    kv_transfer_failed: bool = False  # the error is a failed KV transfer (disaggregation): retryable, HTTP 503
    new_prompt_logprobs: list[TokenLogprobs | None] | None = None  # with the first token, when asked for

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def of(cls, request: Request, new_token_ids: list[int], new_logprobs: list[TokenLogprobs] | None = None,
           new_prompt_logprobs: list[TokenLogprobs | None] | None = None) -> EngineCoreOutput:
        """The request's new tokens, with where it stands now (finished or not, and why)."""
        return cls(request.request_id, new_token_ids, new_logprobs, request.status.finish_reason, request.stop_reason,
                   request.num_cached_tokens or 0, request.num_preemptions, request.first_scheduled_time,
                   new_prompt_logprobs=new_prompt_logprobs)

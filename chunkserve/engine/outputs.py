"""What the engine hands back per request (shaped like vLLM's RequestOutput)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from chunkserve.core.messages import ForwardMode, TokenLogprobs


@dataclass
class Logprob:
    """vLLM's per-token entry of a logprobs dict: the log-probability, the rank in the whole
    vocabulary (1 = most likely) and the token's text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


LogprobDict = dict[int, Logprob]  # token id -> Logprob: the chosen token and the top k (vLLM's shape)


def logprob_dict(record: TokenLogprobs, token_text: Callable[[int], str]) -> LogprobDict:
    """The engine's record of one position -> vLLM's dict: the chosen (sampled or prompt) token
    first, with its rank in the vocabulary, then the top k with ranks 1..k (a chosen token among
    them keeps its place, as in vLLM). The one conversion the offline API, beam search and the
    server's prompt_logprobs share."""
    entries = {record.token_id: Logprob(record.logprob, record.rank, token_text(record.token_id))}
    for rank, (token_id, logprob) in enumerate(record.top, start=1):
        entries[token_id] = Logprob(logprob, rank, token_text(token_id))
    return entries


@dataclass
class CompletionOutput:
    index: int
    text: str  # the whole output text so far (only this step's, for a request whose output_kind is DELTA)
    token_ids: list[int]  # the whole output so far (likewise)
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    text_delta: str = ""  # text added by this step (what a stream sends)
    new_token_ids: list[int] = field(default_factory=list)  # tokens added by this step
    # one per output token, when requested: the engine's records; LLM.generate hands vLLM's dicts instead
    logprobs: list[TokenLogprobs] | list[LogprobDict] | None = None
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)  # those of new_token_ids
    # the output tokens' summed logprobs, when logprobs were requested (LLM.generate's and beam search's outputs)
    cumulative_logprob: float | None = None


@dataclass
class RequestMetrics:
    arrival_time: float  # wall clock (time.time()) when the request was added
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # wall-clock time of each output token
    finished_time: float | None = None
    num_preemptions: int = 0
    max_tokens: int | None = None  # the request's, resolved (vLLM's request_params_max_tokens observes it)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens read from the prefix cache instead of computed
    # prompt_logprobs: one per prompt token, None for the first (vLLM's shape, with our record for each dict;
    # LLM.generate hands the dicts); every output has them once they came, a DELTA stream's first output only
    prompt_logprobs: list[TokenLogprobs | None] | list[LogprobDict | None] | None = None


@dataclass(frozen=True)
class StepRecord:
    """The composition and duration of one engine step."""

    step_id: int
    start_time: float  # wall clock
    duration_s: float
    predicted_duration_s: float | None  # by the step-time model before the step ran (None: no model yet)
    prediction_error_p50: float | None  # |predicted - actual| / actual over recent steps
    prediction_error_p90: float | None
    slo_margin: float  # the model's safety margin as the step was scheduled: the TBT SLO budget aims at SLO / margin
    prefill_wait_guard: bool  # a prompt got tokens past the TBT SLO because it had waited too long
    forward_mode: ForwardMode
    num_prefill_tokens: int
    num_decode_tokens: int
    num_requests: int
    num_preemptions: int
    kv_cache_usage: float  # fraction of KV blocks in use after the step
    prefix_cache_queries: int  # prompt tokens of the requests admitted (for the first time) in this step
    prefix_cache_hits: int  # of those, found in the prefix cache
    prefix_cache_hit_rate: float  # hits / queries since the engine started
    kv_transfer_bytes: int = 0  # disaggregated: KV bytes sent (prefill) or copied in (decode) since the last record
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified in the step
    num_accepted_tokens: int = 0  # of those, accepted
    grammar_mask_s: float = 0.0  # structured outputs: seconds spent filling the step's grammar bitmasks
    grammar_compile_s: tuple[float, ...] = ()  # grammars compiled (off the step loop) since the last record
    num_encoder_inputs: int = 0  # images: encoded in the step (atomic, before its forward)
    num_encoder_embeds: int = 0  # their encoder output rows
    encoder_cache_hits: int = 0  # images a request found in the encoder cache in the step (not encoded again)
    encoder_s: float = 0.0  # the vision encoder's seconds within duration_s
    # pipelined (the step was in flight from start_time for duration_s, beside others): the requests it
    # computed, decodes first, and those of them it sampled
    request_ids: tuple[str, ...] = ()
    sampled_request_ids: tuple[str, ...] = ()
    # several ranks: one dict per rank (RankStepStats): rank, its step's seconds (compute_s, its collectives
    # included), and its collectives (comm_ops, comm_bytes, comm_s)
    ranks: tuple[dict, ...] = ()
    deterministic: bool = False  # the engine runs in deterministic mode (--deterministic)
    # the step-time model's inputs (StepShape: prefill_rows, decode_rows, prefill_attention, decode_attention,
    # draft_rows, encoder_embeds): what `chunkserve profile` fits a step-time profile to
    shape: tuple[int, ...] = ()
    # each request computing its prompt in the step: (request id, first position, tokens, prompt length), so a
    # viewer (/dashboard) can show every prompt's progress; a recompute after a preemption runs past its prompt
    prompt_chunks: tuple[tuple[str, int, int, int], ...] = ()

    def to_dict(self) -> dict:
        """One line of a step trace (JSON-ready)."""
        return {**dataclasses.asdict(self), "forward_mode": self.forward_mode.value}

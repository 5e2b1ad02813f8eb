"""A request as the scheduler sees it: token counters plus a status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from chunkserve.core.disagg.protocol import TransferParams
from chunkserve.core.multimodal import MultiModalFeature
from chunkserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"  # its KV is being loaded by the KV connector
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in FINISHED_STATUSES

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self)


FINISHED_STATUSES = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}
)
FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    """NOTE: there is no prefill or decode phase. A request has `num_tokens` (prompt +
    output so far) and `num_computed_tokens` (tokens whose KV is in the cache); every step
    the scheduler gives it tokens so that the second catches up with the first. A chunked
    prompt, a decode and a recompute after preemption are all this one rule.

    A decode may also carry draft tokens (`spec_token_ids`, proposed by speculative decoding):
    they are computed with its last token in one step, and only those the model accepts become
    output tokens; `num_computed_tokens` then counts verified tokens only.

    `sampling_params.max_tokens` is resolved (never None) by the input processor."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.time)  # wall clock
    priority: int = 0  # lower value = served first (vLLM's convention)
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache blocks
    output_token_ids: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens to verify in the next step
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id that ended it
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    first_scheduled_time: float | None = None  # wall clock of the step that first scheduled it
    generator_state: bytes | None = None  # an imported seeded request's generator, for the worker
    kv_transfer_params: TransferParams | None = None  # disaggregated: the room its KV goes to or comes from
    admission_seq: int = 0  # when it last started running, in the scheduler's count: the latest is preempted first
    mm_features: list[MultiModalFeature] = field(default_factory=list)  # its images' placeholder ranges, in order

    def __post_init__(self) -> None:
        if self.sampling_params.max_tokens is None:
            raise ValueError("a scheduler request needs a resolved max_tokens (the input processor sets it)")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Computes its whole prompt, whatever the prefix cache (or a KV tier) holds: prompt
        logprobs need every prompt row's logits (vLLM's rule). Its blocks are still cached."""
        return self.sampling_params.prompt_logprobs is not None

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_decoding(self) -> bool:
        """True when the prompt is computed and only the last sampled token (with any drafts
        after it) is missing from the cache."""
        return self.num_computed_tokens >= self.num_prompt_tokens and self.num_computed_tokens == self.num_tokens - 1

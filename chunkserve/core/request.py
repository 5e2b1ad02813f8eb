"""A request as the scheduler sees it: token counters plus a status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from chunkserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered so that every status after PREEMPTED is a finished one."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    """NOTE: there is no prefill or decode phase. A request has `num_tokens` (prompt +
    output so far) and `num_computed_tokens` (tokens whose KV is in the cache); every step
    the scheduler gives it tokens so that the second catches up with the first. A chunked
    prompt, a decode and a recompute after preemption are all this one rule."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.time)  # wall clock
    priority: int = 0  # lower value = served first (vLLM's convention)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    block_hashes: list[bytes] = field(default_factory=list, repr=False)  # of its full blocks, kept by the KV manager

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
        """Resolved by the engine at admission, so never None here."""
        assert self.sampling_params.max_tokens is not None, "engine must resolve max_tokens"
        return self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_decoding(self) -> bool:
        """True when only the last sampled token is missing from the cache."""
        return self.num_computed_tokens >= self.num_prompt_tokens and self.num_computed_tokens == self.num_tokens - 1

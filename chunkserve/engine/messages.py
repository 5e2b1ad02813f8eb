"""What crosses between the frontend (tokenizer, detokenizer, API) and the engine core:
token ids only, and per step only what is new.

Commands go to the core between steps, in the order they were sent; events come back. All
are plain picklable data, so the same loop runs on a thread beside the caller or in a
process of its own (`chunkserve serve`). `EngineCoreOutputs` is the per-step event: one
`EngineCoreOutput` (core/messages.py) per request that got tokens or finished, whose size
does not grow with the request's history.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from chunkserve.core.disagg.protocol import TransferParams
from chunkserve.core.kv.snapshot import RequestSnapshot
from chunkserve.core.messages import EngineCoreOutput
from chunkserve.core.multimodal import MultiModalFeature
from chunkserve.core.stats import SchedulerStats
from chunkserve.engine.outputs import StepRecord
from chunkserve.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    """A request as the core takes it: tokenized, its parameters resolved (max_tokens set,
    the model's extra EOS ids among stop_token_ids) by the input processor."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float  # wall clock
    priority: int = 0
    cache_salt: str | None = None  # namespaces the request's prefix-cache hashes
    kv_transfer_params: TransferParams | None = None  # disaggregated: its room and prefill instance
    mm_features: list[MultiModalFeature] = field(default_factory=list)  # its images, in prompt order


def imported_core_request(snapshot: RequestSnapshot, request_id: str | None = None) -> EngineCoreRequest:
    """The request a snapshot continues, as the frontend tracks it: under `request_id`, else the
    caller's id it was exported with."""
    exported_id = (snapshot.frontend_state or {}).get("request_id", snapshot.request_id)
    return EngineCoreRequest(request_id or exported_id, list(snapshot.prompt_token_ids), snapshot.sampling_params,
                             snapshot.eos_token_id, snapshot.arrival_time, snapshot.priority, snapshot.cache_salt)


@dataclass(frozen=True)
class EngineInfo:
    """What the frontend needs to know of the engine core it cannot see."""

    model_name: str
    max_model_len: int
    vocab_size: int
    cpu_threads: dict | None = None  # the compute threads (executor/cpu_threads.py), where this process runs them
    max_num_batched_tokens: int = 0  # the step's token budget, resolved (/dashboard draws it)


# ----- commands (frontend -> core) ----------------------------------------------------------

@dataclass
class AddRequest:
    request: EngineCoreRequest


@dataclass
class AbortRequests:
    request_ids: list[str] | None  # None: every request in flight


@dataclass
class CallCore:
    """Run one of the core's queries between steps; answered by a `CoreCallResult`."""

    ticket: int  # echoed in the answer
    method: Literal["reset_prefix_cache", "check", "cached_blocks"]


@dataclass
class ExportRequest:
    """Snapshot a request between steps; answered by a `CoreCallResult` carrying the
    RequestSnapshot. `pause` removes it from the core (no output follows)."""

    ticket: int
    request_id: str
    mode: Literal["copy", "pause"]
    skip_block_hashes: frozenset[bytes] = frozenset()  # the destination caches them: no payload


@dataclass
class ImportRequest:
    """Continue an exported request under `request_id`; answered by `Accepted`."""

    snapshot: RequestSnapshot
    request_id: str


@dataclass
class Shutdown:
    """Abort whatever is in flight, answer `Stopped`, end the loop."""


@dataclass
class WorkersFailed:
    """The executor's workers failed while the loop waited for commands (a worker process
    died): the loop ends with `EngineDied`."""

    error: BaseException


Command = AddRequest | AbortRequests | CallCore | ExportRequest | ImportRequest | Shutdown | WorkersFailed


# ----- events (core -> frontend) ------------------------------------------------------------

@dataclass
class Ready:
    info: EngineInfo


@dataclass
class Accepted:
    request_id: str
    error: BaseException | None  # None: queued; else why it was refused


@dataclass
class EngineCoreOutputs:
    """A step ran (`record` set) or requests were aborted or failed (`record` None): what each
    request got, stamped with the wall-clock time the step ended."""

    outputs: list[EngineCoreOutput]
    timestamp: float
    record: StepRecord | None
    stats: SchedulerStats


@dataclass
class CoreCallResult:
    ticket: int
    result: object
    error: BaseException | None = None  # the call was refused (InvalidRequestError, ...)


@dataclass
class EngineDied:
    error: BaseException


@dataclass
class Stopped:
    pass


Event = Ready | Accepted | EngineCoreOutputs | CoreCallResult | EngineDied | Stopped

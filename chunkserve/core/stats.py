"""What each feature counts, as the engine core reports it with every step and /metrics shows:
the scheduler's queues and KV pool (`SchedulerStats`), and within it the disk KV tier's, the
disaggregated transfers' and speculative decoding's totals; and each rank's share of a
step (`RankStepStats`, in `ModelRunnerOutput`). Plain frozen data, no torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankStepStats:
    """One rank's share of a step: its compute seconds (the step on that rank, its collectives
    included) and the collectives it ran (tensor-parallel all-reduces, the logits gather,
    pipeline sends and receives): how many, their bytes, their seconds."""

    rank: int
    compute_s: float
    comm_ops: int = 0
    comm_bytes: int = 0
    comm_s: float = 0.0
    p2p_s: float = 0.0  # of comm_s, the pipeline's sends and receives

    @property
    def stage_s(self) -> float:
        """The rank's own work: its step less its pipeline sends and receives (which are mostly
        waiting for the stage before it; its tensor-parallel collectives are part of the work)."""
        return max(self.compute_s - self.p2p_s, 0.0)


def hit_rate(hits: int, queries: int) -> float:
    """hits / queries, 0.0 before any query."""
    return hits / queries if queries else 0.0


@dataclass(frozen=True)
class KVTierStats:
    """A KV tier's running totals (the disk tier's, /metrics' `chunkserve:hicache_*`): what its
    loads supplied (tokens that were not computed) and cost, what its stores wrote and cost,
    blocks found corrupt (each a miss, recomputed), and what it holds now."""

    hit_tokens_total: int = 0
    load_bytes_total: int = 0
    load_seconds_total: float = 0.0
    store_bytes_total: int = 0
    store_seconds_total: float = 0.0
    corrupt_blocks_total: int = 0
    stored_files: int = 0
    stored_bytes: int = 0


RECENT_LATENCIES = 256


@dataclass(frozen=True)
class KVTransferStats:
    """A disaggregated instance's transfers (/metrics' `chunkserve:kv_transfer_*`): requests by
    state now, totals, and the latencies of the most recent transfers (the last of them belongs
    to transfer number `transfers_total`: an observer turns the ones it has not seen into a
    histogram)."""

    role: str  # "prefill" | "decode"
    num_bootstrapping: int = 0  # waiting for the other side's bootstrap (prefill) or for blocks (decode)
    num_preallocated: int = 0  # blocks held, no KV moved yet
    num_transferring: int = 0  # KV moving
    bytes_total: int = 0  # sent (prefill) or copied into the pool (decode)
    transfers_total: int = 0
    failed_total: int = 0
    late_messages_total: int = 0  # decode: messages that arrived for requests already ended here (dropped)
    recent_latencies: tuple[float, ...] = ()  # seconds, oldest first


@dataclass(frozen=True)
class SpecDecodeStats:
    """Running totals (vLLM's `spec_decode_*` counters): draft runs verified, draft tokens
    verified, drafts accepted, and accepted drafts by position in their run (0 = first)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying decode makes per step: its own plus its accepted drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


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
    num_cached_blocks: int = 0  # blocks the prefix cache can find by hash, held by requests or free
    kv_tier: KVTierStats | None = None  # the KV connector's tier (disk tier), when it has one
    kv_transfer: KVTransferStats | None = None  # prefill/decode disaggregation's transfers, when disaggregated
    spec_decode: SpecDecodeStats | None = None  # speculative decoding's counts, when it is configured
    encoder_inputs_total: int = 0  # images encoded
    encoder_embeds_total: int = 0  # their encoder output rows
    encoder_cache_hits_total: int = 0  # images a request found in the encoder cache (not encoded again)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return hit_rate(self.prefix_cache_hits_total, self.prefix_cache_queries_total)

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

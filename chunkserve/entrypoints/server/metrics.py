"""Prometheus metrics, named after vLLM's with a `chunkserve:` prefix, so that a vLLM Grafana
dashboard works once `vllm:` is renamed (docs/grafana.json is vLLM's layout with a few panels more).

vLLM's metrics keep vLLM's meaning, type, buckets and labels: `model_name`, and `engine` (vLLM
numbers its data-parallel engine cores; a server here has one, "0"). /metrics also carries the
frontend process's `process_*` and `python_*` metrics, as vLLM's does.

`EngineMetrics.observe` is an AsyncLLM step observer: it runs on the thread that receives
the engine's events after every step (prometheus_client's metrics are thread-safe) and reads only the step record,
the outputs and the scheduler's stats.

With `--metrics-compat vllm` (and/or `sglang`) the load and cache series that routers scrape (SMG,
llm-d, vllm-router) are also exported under vLLM's (SGLang's) own names: the same metric objects
rendered a second time, so the names can never disagree.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from chunkserve.config.engine import EngineArgs
from chunkserve.core.stats import SchedulerStats
from chunkserve.engine.outputs import RequestOutput, StepRecord

ENGINE_INDEX = "0"  # the `engine` label's value: one engine core per server
# vLLM's buckets (vllm/v1/metrics/loggers.py), so that its dashboards' quantiles and heatmaps read the same
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                      40.0, 80.0)
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                            240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)
_GRAMMAR_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
# ours
_STEP_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
                 80.0, 160.0)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FORWARD_MODES = ("EXTEND", "MIXED", "DECODE")
FINISH_REASONS = ("stop", "length", "abort")
DEFAULT_MAX_MODEL_LEN = 32768
# `--metrics-compat`: our series (by name without the prefix) that routers read, under another engine's names.
# vLLM's: SMG's load of a vLLM worker (kv_cache/gpu_cache_usage_perc, running, waiting), llm-d's scorers (those and
# cache_config_info's block_size and num_gpu_blocks), prefix-cache dashboards
VLLM_COMPAT_SERIES = {name: f"vllm:{name}" for name in (
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "gpu_cache_usage_perc", "cache_config_info",
    "prefix_cache_queries", "prefix_cache_hits")}
# SGLang's: SMG's load of an SGLang worker (a prefill or decode instance is one to SMG); token_usage is the fraction of
# the KV pool's tokens in use, as our kv_cache_usage_perc
SGLANG_COMPAT_SERIES = {"num_requests_running": "sglang:num_running_reqs",
                        "num_requests_waiting": "sglang:num_queue_reqs", "kv_cache_usage_perc": "sglang:token_usage"}
COMPAT_SERIES = {"vllm": VLLM_COMPAT_SERIES, "sglang": SGLANG_COMPAT_SERIES}


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value`: vLLM's buckets of per-request token counts."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


def cache_config_labels(engine_args: EngineArgs) -> dict[str, str]:
    """`cache_config_info`'s labels, named as vLLM's CacheConfig fields where they mean the same
    (`num_gpu_blocks`, the pool's size, comes from the engine's stats)."""
    return {
        "block_size": str(engine_args.block_size),
        "cache_dtype": engine_args.dtype,  # the KV pool's (--dtype, auto resolved for this CPU)
        "enable_prefix_caching": str(engine_args.enable_prefix_caching),
        "prefix_caching_hash_algo": "sha256",
        "num_gpu_blocks_override": str(engine_args.num_kv_blocks),
        "deterministic": str(engine_args.deterministic),  # chunkserve's: whether a hit gives the bits of a miss
    }


class _Renamed(Collector):
    """Other metrics' current samples under other names (`chunkserve:kv_cache_usage_perc` ->
    `vllm:kv_cache_usage_perc`; a counter's `_total` and `_created` samples follow their family)."""

    def __init__(self, sources: list[tuple[MetricWrapperBase, str]]) -> None:
        self._sources = sources  # (metric, its other name)

    def collect(self) -> list[Metric]:
        families = []
        for source, name in self._sources:
            for family in source.collect():
                renamed = Metric(name, family.documentation, family.type)
                for sample in family.samples:
                    renamed.add_sample(name + sample.name.removeprefix(family.name), sample.labels, sample.value,
                                       sample.timestamp, sample.exemplar)
                families.append(renamed)
        return families


class EngineMetrics:
    def __init__(self, model_name: str, *, max_model_len: int = DEFAULT_MAX_MODEL_LEN,
                 engine_args: EngineArgs | None = None, metrics_compat: tuple[str, ...] = ()) -> None:
        """`max_model_len` bounds the buckets of per-request token counts (as vLLM's);
        `engine_args` gives `cache_config_info` its labels (without them it has the pool's size only);
        `metrics_compat`: engines ("vllm", "sglang") whose names COMPAT_SERIES also exports some series under."""
        self.registry = CollectorRegistry()
        for collector in (ProcessCollector, PlatformCollector, GCCollector):
            collector(registry=self.registry)
        labels = {"model_name": model_name, "engine": ENGINE_INDEX}
        names = list(labels)

        families: dict[str, MetricWrapperBase] = {}  # by name without the prefix, for metrics_compat

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            families[name] = Counter(f"chunkserve:{name}", doc, names + list(extra), registry=self.registry)
            return families[name]

        def gauge(name: str, doc: str) -> Gauge:
            families[name] = Gauge(f"chunkserve:{name}", doc, names, registry=self.registry)
            return families[name].labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"chunkserve:{name}", doc, names, buckets=buckets, registry=self.registry).labels(**labels)

        self._labels = labels
        self.num_requests_running = gauge("num_requests_running", "Requests in the running set")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting for admission")
        self.num_requests_swapped = gauge(
            "num_requests_swapped", "Preempted requests waiting to be recomputed (vLLM's name)")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1)")
        self.gpu_cache_usage = gauge(
            "gpu_cache_usage_perc", "kv_cache_usage_perc under vLLM's older name, which its dashboards still read")
        self.kv_cache_free_blocks = gauge("kv_cache_free_blocks", "KV cache blocks in the free pool")
        self.kv_cache_total_blocks = gauge("kv_cache_total_blocks", "KV cache blocks in the pool")
        self._cache_config = cache_config_labels(engine_args) if engine_args is not None else {}
        self.cache_config_info = Gauge(
            "chunkserve:cache_config_info", "The KV cache's configuration as labels (the value is always 1)",
            names + [*self._cache_config, "num_gpu_blocks"], registry=self.registry)
        families["cache_config_info"] = self.cache_config_info
        self._cache_info_blocks: int | None = None  # the pool size cache_config_info shows
        self.num_preemptions = counter("num_preemptions", "Preemptions (by recompute)").labels(**labels)
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens of new requests looked up in the prefix cache (recomputes after "
            "a preemption not counted)").labels(**labels)
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed)").labels(**labels)
        self.encoder_inputs = counter("encoder_inputs", "Images the vision encoder encoded").labels(**labels)
        self.encoder_embeds = counter("encoder_embeds", "Encoder output rows of the images encoded").labels(**labels)
        self.encoder_cache_hits = counter(
            "encoder_cache_hits", "Images a request found in the encoder cache (not encoded again)").labels(**labels)
        self.encoder_seconds = counter("encoder_seconds", "Seconds the vision encoder ran").labels(**labels)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that got their first token").labels(
            **labels)
        self.generation_tokens = counter("generation_tokens", "Generated tokens").labels(**labels)
        self.request_success = counter("request_success", "Finished requests by finish reason", ("finished_reason",))
        self.engine_steps = counter("engine_steps", "Engine steps by forward mode", ("forward_mode",))
        # tensor/pipeline parallel: each rank's collectives (all-reduces, logits gather, stage sends/receives)
        self.comm_ops = counter("comm_ops", "Collective operations run by each worker rank", ("rank",))
        self.comm_bytes = counter("comm_bytes", "Payload bytes of each worker rank's collective operations", ("rank",))
        self.comm_seconds = counter("comm_seconds", "Seconds each worker rank spent in collective operations",
                                    ("rank",))
        self.rank_compute_seconds = counter(
            "rank_step_seconds", "Seconds each worker rank spent on steps (its collectives included)", ("rank",))
        for reason in FINISH_REASONS:
            self.request_success.labels(**labels, finished_reason=reason)
        for mode in FORWARD_MODES:
            self.engine_steps.labels(**labels, forward_mode=mode)
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first output token", _TTFT_BUCKETS)
        gap = ("Gap between a request's consecutive outputs (one per step that brought it tokens: several at once "
               "where speculative decoding accepted drafts)")
        self.inter_token_latency = histogram("inter_token_latency_seconds", gap, _TOKEN_GAP_BUCKETS)
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", f"{gap}; inter_token_latency_seconds under vLLM's older name",
            _TOKEN_GAP_BUCKETS)
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds", "Per request of 2 tokens or more: (last - first token time) / "
            "(tokens - 1)", _TOKEN_GAP_BUCKETS)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to finish", _REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled (WAITING)", _REQUEST_LATENCY_BUCKETS)
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token (PREFILL)", _REQUEST_LATENCY_BUCKETS)
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "First token to last token (DECODE)", _REQUEST_LATENCY_BUCKETS)
        self.request_inference_time = histogram(
            "request_inference_time_seconds", "First scheduled to last token (RUNNING: prefill and decode)",
            _REQUEST_LATENCY_BUCKETS)
        token_counts = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens of each finished request", token_counts)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Output tokens of each finished request", token_counts)
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens", "Output tokens of the longest of a finished request's samples",
            token_counts)
        self.request_params_n = histogram("request_params_n", "The n of each finished request", _N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens of each finished request (when none was given: what "
            "max_model_len left it)", token_counts)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens computed per engine step (prompt and decode; steps with any)",
            _ITERATION_TOKEN_BUCKETS)
        self.step_prefill_tokens = histogram(
            "step_prefill_tokens", "Prompt tokens per engine step (steps with any)", _TOKEN_BUCKETS)
        self.step_decode_batch_size = histogram(
            "step_decode_batch_size", "Decode tokens per engine step (steps with any)", _TOKEN_BUCKETS)
        self.step_duration = histogram("step_duration_seconds", "Wall time of one engine step", _STEP_BUCKETS)
        self.grammar_compile = histogram(
            "structured_output_compile_seconds", "Compile time of each structured-output grammar not in the cache "
            "(on the engine core's grammar thread, off the step loop)", _GRAMMAR_BUCKETS)
        self.grammar_mask = histogram(
            "structured_output_mask_seconds", "Seconds a step spent filling grammar bitmasks (steps with any)",
            _GRAMMAR_BUCKETS)
        error = Gauge("chunkserve:step_time_prediction_relative_error",
                      "|predicted - actual| / actual step time of the step-time model over recent steps, by quantile",
                      names + ["quantile"], registry=self.registry)
        self.prediction_error = {q: error.labels(**labels, quantile=str(q)) for q in (0.5, 0.9)}
        self.prefill_wait_guards = counter(
            "prefill_wait_guards", "Steps where a prompt got tokens past the TBT SLO after waiting "
            "--max-prefill-wait-ms").labels(**labels)
        self.requests_aborted_unread = counter(
            "requests_aborted_unread", "Streamed requests aborted because their client left "
            "--max-unread-outputs outputs unread").labels(**labels)
        # the disk KV tier (--enable-hierarchical-cache); the pool's own hits are prefix_cache_hits
        self.hicache_hit_tokens = counter(
            "hicache_hit_tokens", "Prompt tokens loaded from the disk KV tier (not computed)").labels(**labels)
        self.hicache_load_bytes = counter("hicache_load_bytes", "Bytes read from the disk KV tier").labels(**labels)
        self.hicache_load_seconds = counter(
            "hicache_load_seconds", "Seconds the disk KV tier's I/O thread spent reading (and checking) blocks"
        ).labels(**labels)
        self.hicache_store_bytes = counter("hicache_store_bytes", "Bytes written to the disk KV tier").labels(**labels)
        self.hicache_store_seconds = counter(
            "hicache_store_seconds", "Seconds the disk KV tier's I/O thread spent writing blocks").labels(**labels)
        self.hicache_corrupt_blocks = counter(
            "hicache_corrupt_blocks", "Disk KV tier block files found corrupt or not this model's (removed, "
            "their tokens recomputed)").labels(**labels)
        self.hicache_stored_bytes = gauge("hicache_stored_bytes", "Bytes of block files the disk KV tier holds")
        # prefill/decode disaggregation (a prefill instance counts what it sent, a decode one what it received)
        self.kv_transfer_latency = histogram(
            "kv_transfer_latency_seconds", "Seconds from a request's bootstrap to its last KV block (decode side), or "
            "from its first block sent to its final message (prefill side)",
            (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0))
        self.kv_transfer_bytes = counter(
            "kv_transfer_bytes", "KV bytes sent to decode instances (prefill) or copied into the pool from prefill "
            "instances (decode)").labels(**labels)
        self.kv_transfer_requests = counter("kv_transfer_requests", "Requests whose KV transfer finished").labels(
            **labels)
        self.kv_transfer_failed = counter(
            "kv_transfer_failed", "Requests whose KV transfer failed (aborted: timeout, corrupted block, bootstrap "
            "refused, the other instance gone)").labels(**labels)
        self.kv_transfer_late_messages = counter(
            "kv_transfer_late_messages", "Decode: messages from prefill instances that arrived for requests already "
            "ended here (aborted, failed or timed out), dropped unread").labels(**labels)
        self.kv_transfer_bootstrapping = gauge(
            "kv_transfer_requests_bootstrapping", "Requests whose other side has not bootstrapped yet (prefill), or "
            "waiting for their blocks to be pre-allocated (decode)")
        self.kv_transfer_preallocated = gauge(
            "kv_transfer_requests_preallocated", "Decode: requests with pre-allocated blocks and no KV yet")
        self.kv_transfer_transferring = gauge("kv_transfer_requests_transferring", "Requests whose KV is moving")
        # speculative decoding (vLLM's names): mean acceptance length = 1 + accepted_tokens / drafts
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts", "Draft runs verified (one per decode that carried drafts)").labels(**labels)
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Draft tokens verified").labels(**labels)
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted").labels(**labels)
        self.spec_decode_num_accepted_tokens_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by position in their run (0 = first)",
            ("position",))
        self._totals_seen: dict[Counter, int] = {}
        # request id -> its prompt's samples (n > 1), shared by the server's loop and the engine's output thread
        self._sample_groups: dict[str, _SampleGroup] = {}
        self._groups_lock = threading.Lock()
        for engine in metrics_compat:
            self.registry.register(_Renamed([(families[ours], theirs)
                                             for ours, theirs in COMPAT_SERIES[engine].items()]))

    def observe(self, record: StepRecord | None, outputs: list[RequestOutput], stats: SchedulerStats) -> None:
        if record is not None:
            self._observe_step(record)
        for output in outputs:
            self._observe_output(output)
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.num_requests_swapped.set(stats.num_preempted_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.gpu_cache_usage.set(stats.kv_cache_usage)
        if stats.num_blocks != self._cache_info_blocks:  # the first stats, or a new engine core's pool
            self.cache_config_info.clear()
            self.cache_config_info.labels(**self._labels, **self._cache_config,
                                          num_gpu_blocks=str(stats.num_blocks)).set(1)
            self._cache_info_blocks = stats.num_blocks
        self.kv_cache_free_blocks.set(stats.num_free_blocks)
        self.kv_cache_total_blocks.set(stats.num_blocks)
        self._count_up_to(self.num_preemptions, stats.num_preemptions_total)
        self._count_up_to(self.prefix_cache_queries, stats.prefix_cache_queries_total)
        self._count_up_to(self.prefix_cache_hits, stats.prefix_cache_hits_total)
        self._count_up_to(self.encoder_inputs, stats.encoder_inputs_total)
        self._count_up_to(self.encoder_embeds, stats.encoder_embeds_total)
        self._count_up_to(self.encoder_cache_hits, stats.encoder_cache_hits_total)
        tier = stats.kv_tier
        if tier is not None:
            self._count_up_to(self.hicache_hit_tokens, tier.hit_tokens_total)
            self._count_up_to(self.hicache_load_bytes, tier.load_bytes_total)
            self._count_up_to(self.hicache_load_seconds, tier.load_seconds_total)
            self._count_up_to(self.hicache_store_bytes, tier.store_bytes_total)
            self._count_up_to(self.hicache_store_seconds, tier.store_seconds_total)
            self._count_up_to(self.hicache_corrupt_blocks, tier.corrupt_blocks_total)
            self.hicache_stored_bytes.set(tier.stored_bytes)
        spec = stats.spec_decode
        if spec is not None:
            self._count_up_to(self.spec_decode_num_drafts, spec.num_drafts)
            self._count_up_to(self.spec_decode_num_draft_tokens, spec.num_draft_tokens)
            self._count_up_to(self.spec_decode_num_accepted_tokens, spec.num_accepted_tokens)
            for position, accepted in enumerate(spec.accepted_per_pos):
                self._count_up_to(self.spec_decode_num_accepted_tokens_per_pos.labels(
                    **self._labels, position=str(position)), accepted)
        transfer = stats.kv_transfer
        if transfer is not None:
            unseen = transfer.transfers_total - self._totals_seen.get(self.kv_transfer_requests, 0)
            if unseen < 0:  # a new engine core's
                unseen = transfer.transfers_total
            for seconds in transfer.recent_latencies[len(transfer.recent_latencies) - min(unseen, len(
                    transfer.recent_latencies)):]:
                self.kv_transfer_latency.observe(seconds)
            self._count_up_to(self.kv_transfer_bytes, transfer.bytes_total)
            self._count_up_to(self.kv_transfer_requests, transfer.transfers_total)
            self._count_up_to(self.kv_transfer_failed, transfer.failed_total)
            self._count_up_to(self.kv_transfer_late_messages, transfer.late_messages_total)
            self.kv_transfer_bootstrapping.set(transfer.num_bootstrapping)
            self.kv_transfer_preallocated.set(transfer.num_preallocated)
            self.kv_transfer_transferring.set(transfer.num_transferring)

    def observe_frontend(self, num_unread_aborts: int) -> None:
        """The frontend's own totals (read when /metrics is rendered)."""
        self._count_up_to(self.requests_aborted_unread, num_unread_aborts)

    def _count_up_to(self, counter: Counter, total: float) -> None:
        """Advance a counter to the engine's running total (a total below the last one seen is a
        new engine core's, counting from 0 again)."""
        seen = self._totals_seen.get(counter, 0)
        counter.inc(total - seen if total >= seen else total)
        self._totals_seen[counter] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def _observe_step(self, record: StepRecord) -> None:
        self.engine_steps.labels(**self._labels, forward_mode=record.forward_mode.value).inc()
        for rank in record.ranks:
            labels = {**self._labels, "rank": str(rank["rank"])}
            self.comm_ops.labels(**labels).inc(rank["comm_ops"])
            self.comm_bytes.labels(**labels).inc(rank["comm_bytes"])
            self.comm_seconds.labels(**labels).inc(rank["comm_s"])
            self.rank_compute_seconds.labels(**labels).inc(rank["compute_s"])
        self.step_duration.observe(record.duration_s)
        if record.encoder_s:
            self.encoder_seconds.inc(record.encoder_s)
        for seconds in record.grammar_compile_s:
            self.grammar_compile.observe(seconds)
        if record.grammar_mask_s:
            self.grammar_mask.observe(record.grammar_mask_s)
        if record.num_prefill_tokens + record.num_decode_tokens:
            self.iteration_tokens.observe(record.num_prefill_tokens + record.num_decode_tokens)
        if record.num_prefill_tokens:
            self.step_prefill_tokens.observe(record.num_prefill_tokens)
        if record.num_decode_tokens:
            self.step_decode_batch_size.observe(record.num_decode_tokens)
        if record.prediction_error_p50 is not None:
            self.prediction_error[0.5].set(record.prediction_error_p50)
            self.prediction_error[0.9].set(record.prediction_error_p90)
        if record.prefill_wait_guard:
            self.prefill_wait_guards.inc()

    def _observe_output(self, output: RequestOutput) -> None:
        metrics = output.metrics
        completion = output.outputs[0]
        count = len(completion.new_token_ids)
        if count:  # (several at once where speculative decoding accepted drafts)
            self.generation_tokens.inc(count)
            times = metrics.token_times
            if len(times) == count:
                self.prompt_tokens.inc(len(output.prompt_token_ids))
                self.time_to_first_token.observe(times[0] - metrics.arrival_time)
            else:  # one gap per step that brought tokens, as vLLM
                gap = times[-1] - times[-count - 1]
                self.inter_token_latency.observe(gap)
                self.time_per_output_token.observe(gap)
        if output.finished:
            self._observe_finished(output)

    def expect_samples(self, request_ids: list[str]) -> None:
        """The engine requests that are the n samples of one prompt: `request_params_n` and
        `request_max_num_generation_tokens` observe them once, when the last has finished (as
        vLLM observes a parent request). Call before adding them to the engine."""
        group = _SampleGroup(len(request_ids), len(request_ids))
        with self._groups_lock:
            self._sample_groups.update(dict.fromkeys(request_ids, group))

    def forget_samples(self, request_ids: list[str]) -> None:
        """Samples that will not all be added (one was refused): each is then its own request."""
        with self._groups_lock:
            for request_id in request_ids:
                self._sample_groups.pop(request_id, None)

    def _observe_finished(self, output: RequestOutput) -> None:
        """vLLM's per-request histograms, observed once a request (one sample) finished; n and
        the longest sample's length once its prompt's last sample finished."""
        metrics = output.metrics
        times = metrics.token_times
        self.request_success.labels(**self._labels, finished_reason=output.outputs[0].finish_reason).inc()
        self.e2e_request_latency.observe(metrics.finished_time - metrics.arrival_time)
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(len(times))
        with self._groups_lock:
            group = self._sample_groups.pop(output.request_id, None)
            if group is not None:
                group.remaining -= 1
                group.longest = max(group.longest, len(times))
        if group is None:
            self.request_max_num_generation_tokens.observe(len(times))
            self.request_params_n.observe(1)
        elif group.remaining == 0:
            self.request_max_num_generation_tokens.observe(group.longest)
            self.request_params_n.observe(group.n)
        if metrics.max_tokens is not None:
            self.request_params_max_tokens.observe(metrics.max_tokens)
        scheduled = metrics.first_scheduled_time
        if scheduled is None:  # aborted while it waited: no phase after the queue began
            return
        self.request_queue_time.observe(scheduled - metrics.arrival_time)
        if not times:
            return
        self.request_prefill_time.observe(times[0] - scheduled)
        self.request_decode_time.observe(times[-1] - times[0])
        self.request_inference_time.observe(times[-1] - scheduled)
        if len(times) > 1:
            self.request_time_per_output_token.observe((times[-1] - times[0]) / (len(times) - 1))


@dataclass
class _SampleGroup:
    """The samples of one prompt still running, and the longest output among those finished."""

    n: int
    remaining: int
    longest: int = 0

"""/metrics' vLLM-named metrics from the observer alone (no server): one request's steps at
known times give vLLM's per-request phases, per-gap TPOT and the per-request mean, token and
parameter histograms; the KV cache's configuration and usage under vLLM's names; the `engine`
label on every series; the process's own metrics."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from chunkserve.config.engine import EngineArgs
from chunkserve.core.messages import ForwardMode
from chunkserve.core.stats import SchedulerStats
from chunkserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, StepRecord
from chunkserve.entrypoints.server.metrics import EngineMetrics

ARRIVAL, SCHEDULED = 100.0, 100.5
# the steps that brought the request tokens: (time, tokens), the last of two accepted drafts and a bonus
STEPS = [(101.0, 1), (101.25, 1), (101.5, 3)]
PROMPT = [11, 12, 13, 14, 15]


def stats(num_free_blocks: int = 48, num_blocks: int = 64) -> SchedulerStats:
    return SchedulerStats(num_running=0, num_waiting=0, num_preempted_waiting=0, num_free_blocks=num_free_blocks,
                          num_blocks=num_blocks, num_preemptions_total=0, prefix_cache_queries_total=0,
                          prefix_cache_hits_total=0)


def step(prefill: int, decode: int) -> StepRecord:
    return StepRecord(step_id=0, start_time=0.0, duration_s=0.01, predicted_duration_s=None,
                      prediction_error_p50=None, prediction_error_p90=None, slo_margin=1.0, prefill_wait_guard=False,
                      forward_mode=ForwardMode.MIXED, num_prefill_tokens=prefill, num_decode_tokens=decode,
                      num_requests=2, num_preemptions=0, kv_cache_usage=0.25, prefix_cache_queries=0,
                      prefix_cache_hits=0, prefix_cache_hit_rate=0.0)


def run_request(metrics: EngineMetrics, max_tokens: int = 16) -> None:
    """One request through the observer, as the output processor reports it step by step."""
    request = RequestMetrics(arrival_time=ARRIVAL, first_scheduled_time=SCHEDULED, max_tokens=max_tokens)
    for index, (time, count) in enumerate(STEPS):
        last = index == len(STEPS) - 1
        request.token_times.extend([time] * count)
        request.finished_time = time if last else None
        completion = CompletionOutput(0, "", [], finish_reason="length" if last else None,
                                      new_token_ids=[7] * count)
        metrics.observe(None, [RequestOutput("r", None, PROMPT, [completion], last, request)], stats())


def value(metrics: EngineMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(f"chunkserve:{name}", {"model_name": "m", "engine": "0", **labels})


@pytest.fixture
def metrics() -> EngineMetrics:
    return EngineMetrics("m", max_model_len=128, engine_args=EngineArgs(block_size=16, num_kv_blocks=64,
                                                                                   dtype="float32"))


def test_time_per_output_token_is_one_observation_per_gap_and_the_request_mean_is_apart(metrics):
    run_request(metrics)
    gaps = [later - earlier for (earlier, _), (later, _) in zip(STEPS, STEPS[1:])]
    for name in ("time_per_output_token_seconds", "inter_token_latency_seconds"):
        assert value(metrics, f"{name}_count") == len(gaps)
        assert value(metrics, f"{name}_sum") == pytest.approx(sum(gaps))
    tokens = sum(count for _, count in STEPS)
    assert value(metrics, "request_time_per_output_token_seconds_count") == 1
    assert value(metrics, "request_time_per_output_token_seconds_sum") == pytest.approx(
        (STEPS[-1][0] - STEPS[0][0]) / (tokens - 1))


def test_a_finished_request_observes_its_phases_as_vllm_does(metrics):
    run_request(metrics)
    first, last = STEPS[0][0], STEPS[-1][0]
    phases = {"request_queue_time_seconds": SCHEDULED - ARRIVAL, "request_prefill_time_seconds": first - SCHEDULED,
              "request_decode_time_seconds": last - first, "request_inference_time_seconds": last - SCHEDULED,
              "e2e_request_latency_seconds": last - ARRIVAL, "time_to_first_token_seconds": first - ARRIVAL}
    for name, seconds in phases.items():
        assert (value(metrics, f"{name}_count"), value(metrics, f"{name}_sum")) == (1, pytest.approx(seconds)), name


def test_a_finished_request_observes_its_sizes_and_parameters(metrics):
    run_request(metrics, max_tokens=16)
    tokens = sum(count for _, count in STEPS)
    sizes = {"request_prompt_tokens": len(PROMPT), "request_generation_tokens": tokens,
             "request_max_num_generation_tokens": tokens, "request_params_n": 1, "request_params_max_tokens": 16}
    for name, size in sizes.items():
        assert (value(metrics, f"{name}_count"), value(metrics, f"{name}_sum")) == (1, size), name
    # vLLM's 1-2-5 buckets up to max_model_len
    assert value(metrics, "request_prompt_tokens_bucket", le="5.0") == 1
    assert value(metrics, "request_prompt_tokens_bucket", le="2.0") == 0
    assert value(metrics, "request_prompt_tokens_bucket", le="100.0") == 1
    assert value(metrics, "request_prompt_tokens_bucket", le="200.0") is None


def test_iteration_tokens_counts_each_steps_prompt_and_decode_tokens(metrics):
    metrics.observe(step(prefill=40, decode=3), [], stats())
    metrics.observe(step(prefill=0, decode=5), [], stats())
    assert value(metrics, "iteration_tokens_total_count") == 2
    assert value(metrics, "iteration_tokens_total_sum") == 48


def test_kv_cache_usage_under_both_names_and_the_cache_config_as_labels(metrics):
    metrics.observe(None, [], stats(num_free_blocks=48, num_blocks=64))
    assert value(metrics, "kv_cache_usage_perc") == value(metrics, "gpu_cache_usage_perc") == 0.25
    config = {"block_size": "16", "cache_dtype": "float32", "enable_prefix_caching": "True",
              "prefix_caching_hash_algo": "sha256", "num_gpu_blocks_override": "64",
              "deterministic": "False"}
    assert value(metrics, "cache_config_info", **config, num_gpu_blocks="64") == 1
    metrics.observe(None, [], stats(num_free_blocks=100, num_blocks=100))  # a new engine core, a new pool
    info = [s for family in text_string_to_metric_families(metrics.render().decode())
            for s in family.samples if s.name == "chunkserve:cache_config_info"]
    assert [s.labels["num_gpu_blocks"] for s in info] == ["100"]


def test_every_series_carries_the_engine_label_and_the_process_is_described(metrics):
    run_request(metrics)
    families = list(text_string_to_metric_families(metrics.render().decode()))
    ours = [s for family in families for s in family.samples if s.name.startswith("chunkserve:")]
    assert ours and all(s.labels.get("engine") == "0" and s.labels.get("model_name") == "m" for s in ours)
    names = {family.name for family in families}
    assert {"process_cpu_seconds", "process_resident_memory_bytes", "python_info"} <= names


def compat_samples(metrics_compat: tuple[str, ...]) -> tuple[dict, dict]:
    """After one observation: the chunkserve: samples and the others, each by (name, labels)."""
    metrics = EngineMetrics("m", engine_args=EngineArgs(block_size=16, num_kv_blocks=64, dtype="float32"),
                            metrics_compat=metrics_compat)
    metrics.observe(None, [], SchedulerStats(
        num_running=3, num_waiting=2, num_preempted_waiting=0, num_free_blocks=48, num_blocks=64,
        num_preemptions_total=0, prefix_cache_queries_total=40, prefix_cache_hits_total=32))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples
               if not s.name.endswith("_created")}
    ours = {key: v for key, v in samples.items() if key[0].startswith("chunkserve:")}
    return ours, {key: v for key, v in samples.items() if key not in ours and ":" in key[0]}


def test_metrics_compat_vllm_exports_the_load_series_under_vllms_names_with_the_same_values():
    ours, theirs = compat_samples(("vllm",))
    assert {name for name, _ in theirs} == {
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc", "vllm:cache_config_info", "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total"}
    assert all(ours[(name.replace("vllm:", "chunkserve:"), labels)] == v for (name, labels), v in theirs.items())
    by_name = {name: (dict(labels), v) for (name, labels), v in theirs.items()}
    assert by_name["vllm:num_requests_running"][1] == 3 and by_name["vllm:num_requests_waiting"][1] == 2
    assert by_name["vllm:kv_cache_usage_perc"][1] == 0.25 and by_name["vllm:prefix_cache_hits_total"][1] == 32
    info = by_name["vllm:cache_config_info"][0]
    assert (info["block_size"], info["num_gpu_blocks"], info["model_name"]) == ("16", "64", "m")


def test_metrics_compat_sglang_exports_the_load_series_under_sglangs_names():
    _, theirs = compat_samples(("sglang",))
    assert {name: v for (name, _), v in theirs.items()} == {
        "sglang:num_running_reqs": 3, "sglang:num_queue_reqs": 2, "sglang:token_usage": 0.25}


def test_without_metrics_compat_no_other_engines_series(metrics):
    metrics.observe(None, [], stats())
    text = metrics.render().decode()
    assert "vllm:" not in text and "sglang:" not in text

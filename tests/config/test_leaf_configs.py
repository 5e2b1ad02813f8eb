"""The leaf configs: each checks itself when built (a library user building one directly gets
the engine's rules), each flag's default and help text live once, on the leaf, and EngineArgs
builds the resolved leaves with every field passed on."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from chunkserve.config.cache import CacheConfig
from chunkserve.config.disaggregation import DisaggregationConfig
from chunkserve.config.engine import EngineArgs
from chunkserve.config.kv_connector import KVConnectorConfig
from chunkserve.config.kv_tier import KVTierConfig
from chunkserve.config.limits import RequestLimits
from chunkserve.config.multimodal import MultiModalConfig
from chunkserve.config.parallel import ParallelConfig
from chunkserve.config.scheduler import ChunkSchedule, SchedulerConfig
from chunkserve.entrypoints.args import add_cli_args
from chunkserve.errors import InvalidRequestError

BUDGET = dict(max_num_batched_tokens=64, max_num_seqs=16, max_model_len=4096, block_size=16)
LEAVES = (SchedulerConfig, CacheConfig, KVTierConfig, DisaggregationConfig, ParallelConfig, RequestLimits,
          MultiModalConfig)


@pytest.mark.parametrize("fields, message", [
    (dict(max_num_seqs=128), r"max_num_batched_tokens \(64\) must be at least max_num_seqs \(128\), so every "
                             "running decode fits in a step"),
    (dict(enable_chunked_prefill=False), r"with chunked prefill off a whole prompt must fit one step: "
                                         r"max_num_batched_tokens \(64\) must be at least max_model_len \(4096\)"),
    (dict(max_num_batched_tokens=-1), "spelled --no-enable-chunked-prefill"),
    (dict(max_num_batched_tokens=8, max_num_seqs=8), r"must be at least block_size \(16\): chunks are whole blocks"),
    (dict(max_num_seqs=0), "max_num_seqs must be positive, got 0"),
    (dict(long_prefill_token_threshold=8), r"long_prefill_token_threshold must be 0 or at least block_size \(16\)"),
    (dict(max_num_partial_prefills=0), "max_num_partial_prefills must be at least 1"),
    (dict(max_long_partial_prefills=2), r"max_long_partial_prefills \(2\) must be at least 1 and at most"),
    (dict(chunk_align=24), r"chunk_align must be a positive multiple of block_size \(16\), got 24"),
    (dict(tbt_slo_ms=0.0), "tbt_slo_ms must be positive, got 0.0"),
    (dict(ttft_slo_ms=-1.0), "ttft_slo_ms must be positive"),
    (dict(max_prefill_wait_ms=-1.0), "max_prefill_wait_ms must be non-negative"),
    (dict(scheduling_policy="lifo"), "scheduling_policy must be one of"),
])
def test_a_scheduler_config_built_directly_is_checked_as_the_engine_checks_it(fields, message):
    with pytest.raises(InvalidRequestError, match=message):
        SchedulerConfig(**{**BUDGET, **fields})
    SchedulerConfig(**BUDGET, chunk_schedule=ChunkSchedule.parse("64:16:2:256"))  # a sound one passes


@pytest.mark.parametrize("leaf, fields, message", [
    (CacheConfig, dict(block_size=0), "block_size must be positive, got 0"),
    (CacheConfig, dict(kv_cache_memory_gb=0), "kv_cache_memory_gb must be positive"),
    (CacheConfig, dict(kv_cache_memory_bytes=0), "kv_cache_memory_bytes must be positive, got 0"),
    (CacheConfig, dict(num_kv_blocks=0), "num_kv_blocks must be positive"),
    (KVTierConfig, dict(hicache_storage_backend="s3"), "hicache_storage_backend must be one of"),
    (KVTierConfig, dict(hicache_write_policy="never"), "hicache_write_policy must be one of"),
    (KVTierConfig, dict(hicache_storage_max_gb=0), "hicache_storage_max_gb must be positive, got 0"),
    (KVTierConfig, dict(hicache_storage_dir=" "), "hicache_storage_dir must not be empty"),
    (DisaggregationConfig, dict(disaggregation_mode="both"), "disaggregation_mode must be one of"),
    (DisaggregationConfig, dict(disaggregation_transfer_backend="nixl"), "disaggregation_transfer_backend must be"),
    (DisaggregationConfig, dict(disaggregation_bootstrap_port=0), r"disaggregation_bootstrap_port must be in \[1"),
    (DisaggregationConfig, dict(disaggregation_waiting_timeout=0), "disaggregation_waiting_timeout must be positive"),
    (DisaggregationConfig, dict(disaggregation_transfer_window=0), "disaggregation_transfer_window must be at least 1"),
    (RequestLimits, dict(max_prompt_chars=0), "max_prompt_chars must be positive, got 0"),
    (RequestLimits, dict(max_prompt_chars=10, max_logprobs=-1), r"max_logprobs must be in \[0, "),
])
def test_each_leaf_refuses_its_bad_values_by_name(leaf, fields, message):
    with pytest.raises(InvalidRequestError, match=message):
        leaf(**fields)


def test_one_kv_connector_per_engine():
    with pytest.raises(InvalidRequestError, match="cannot be combined yet"):
        KVConnectorConfig(16, KVTierConfig(enable_hierarchical_cache=True), DisaggregationConfig("prefill"))
    assert KVConnectorConfig(16, KVTierConfig(), DisaggregationConfig()).connector is None
    assert KVConnectorConfig(16, KVTierConfig(True), DisaggregationConfig()).connector == "hicache"
    assert KVConnectorConfig(16, KVTierConfig(), DisaggregationConfig("decode")).connector == "decode"


def test_engine_args_refuse_the_leaves_rules_on_creation_with_the_same_messages():
    with pytest.raises(InvalidRequestError, match="spelled --no-enable-chunked-prefill"):
        EngineArgs(max_num_batched_tokens=-1)
    with pytest.raises(InvalidRequestError, match="hicache_write_policy must be one of"):
        EngineArgs(hicache_write_policy="never")
    with pytest.raises(InvalidRequestError, match="disaggregation_bootstrap_port must be in"):
        EngineArgs(disaggregation_bootstrap_port=70000)
    with pytest.raises(InvalidRequestError, match="block_size must be positive"):
        EngineArgs(block_size=0)
    with pytest.raises(InvalidRequestError, match="max_prompt_chars must be positive, got 0"):
        EngineArgs(max_prompt_chars=0)


def test_every_flag_of_a_leaf_takes_its_default_and_help_from_the_leaf():
    leaf_fields = {f.name: f for leaf in LEAVES for f in dataclasses.fields(leaf) if "help" in f.metadata}
    engine_fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    shared = set(leaf_fields) & set(engine_fields)
    assert {"max_num_batched_tokens", "tbt_slo_ms", "block_size", "hicache_write_policy", "disaggregation_mode",
            "tensor_parallel_size", "max_logprobs"} <= shared
    for name in shared:
        assert engine_fields[name].metadata == leaf_fields[name].metadata, name
        if leaf_fields[name].default is not dataclasses.MISSING and name != "max_prompt_chars":
            assert engine_fields[name].default == leaf_fields[name].default, name


def test_the_cli_help_of_a_scheduler_flag_is_the_leaf_fields():
    parser = argparse.ArgumentParser()
    add_cli_args(EngineArgs, parser)
    actions = {action.dest: action for action in parser._actions}
    leaf = {f.name: f for f in dataclasses.fields(SchedulerConfig)}
    for name in ("max_num_batched_tokens", "tbt_slo_ms", "max_prefill_wait_ms", "scheduling_policy"):
        assert actions[name].help == leaf[name].metadata["help"]
    assert actions["max_prefill_wait_ms"].default == leaf["max_prefill_wait_ms"].default
    assert actions["scheduling_policy"].choices == leaf["scheduling_policy"].metadata["choices"]


def test_create_engine_config_passes_every_flag_to_its_leaf():
    args = EngineArgs(max_num_batched_tokens=256, max_num_seqs=32, enable_mixed_batch=False,
                      long_prefill_token_threshold=64, max_num_partial_prefills=2, max_long_partial_prefills=2,
                      chunk_align=32, chunk_schedule="256:64:2:1024", tbt_slo_ms=50.0, max_prefill_wait_ms=500.0,
                      ttft_slo_ms=900.0, scheduling_policy="priority", enable_prefix_caching=False, block_size=32,
                      kv_cache_memory_bytes=2**28, hicache_storage_max_gb=3.0, disaggregation_mode="decode",
                      disaggregation_waiting_timeout=5.0, max_stop_sequences=3, max_logprobs=5,
                      max_num_batched_encoder_embeds=300, encoder_cache_size=600, disable_chunked_mm_input=True)
    config = args.create_engine_config(max_model_len=2048, max_tokens_per_mm_item=200)
    scheduler = config.scheduler
    for name in ("max_num_batched_tokens", "max_num_seqs", "enable_mixed_batch", "long_prefill_token_threshold",
                 "max_num_partial_prefills", "max_long_partial_prefills", "chunk_align", "tbt_slo_ms",
                 "max_prefill_wait_ms", "ttft_slo_ms", "scheduling_policy", "enable_prefix_caching", "block_size",
                 "max_num_batched_encoder_embeds", "encoder_cache_size", "disable_chunked_mm_input"):
        assert getattr(scheduler, name) == getattr(args, name), name
    assert scheduler.chunk_schedule == ChunkSchedule.parse("256:64:2:1024")
    assert scheduler.max_model_len == 2048
    assert (scheduler.max_tokens_per_mm_item, scheduler.encoder_compute_budget, scheduler.encoder_cache_capacity) == \
        (200, 300, 600)
    assert config.cache.kv_cache_bytes == args.kv_cache_bytes == 2**28
    assert config.kv_connector.connector == "decode"
    assert config.kv_connector.disaggregation.disaggregation_waiting_timeout == 5.0
    assert config.kv_connector.kv_tier.hicache_storage_max_gb == 3.0
    assert (config.request_limits.max_stop_sequences, config.request_limits.max_logprobs) == (3, 5)


def test_the_pipeline_depth_and_the_token_source_come_from_the_parallel_flags():
    args = EngineArgs(pipeline_parallel_size=2)
    scheduler = args.scheduler_config(4096)
    assert scheduler.max_steps_in_flight == args.parallel_config().max_steps_in_flight == 2
    assert scheduler.tokens_from_steps and args.tokens_from_steps  # mp: only one rank samples
    assert not EngineArgs().scheduler_config(4096).tokens_from_steps


def test_the_budget_defaults_follow_chunking_and_the_slo():
    def resolved(max_model_len: int = 4096, **flags) -> tuple[int, int]:
        config = EngineArgs(**flags).scheduler_config(max_model_len)
        return config.max_num_batched_tokens, config.max_num_seqs

    assert resolved() == (512, 128)
    assert resolved(tbt_slo_ms=50.0) == (2048, 128)
    assert resolved(enable_chunked_prefill=False) == (4096, 128)
    assert resolved(256, enable_chunked_prefill=False) == (512, 128)
    assert resolved(max_num_batched_tokens=64) == (64, 64)  # max_num_seqs: at most the budget

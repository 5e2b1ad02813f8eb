"""The parallel flags: vLLM's names and short forms, the layer split, and what is refused."""

from __future__ import annotations

import pytest

from chunkserve.config.engine import EngineArgs
from chunkserve.config.parallel import ParallelConfig, parse_layer_partition
from chunkserve.entrypoints.args import ServerArgs, from_cli_args
from chunkserve.entrypoints.cli import apply_torchrun_env, build_parser
from chunkserve.errors import InvalidRequestError


def test_vllm_flags_and_short_forms_parse():
    args = build_parser().parse_args(["serve", "-tp", "3", "-pp", "2", "--distributed-executor-backend", "mp",
                                      "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                                      "--master-port", "29600", "--headless", "--pp-layer-partition", "12,18"])
    engine, server = from_cli_args(EngineArgs, args), from_cli_args(ServerArgs, args)
    parallel = engine.parallel_config()
    assert (parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.world_size) == (3, 2, 6)
    assert parallel.local_ranks == range(3, 6) and parallel.output_rank == 3 and parallel.control_port == 29601
    assert server.headless and engine.executor_backend == "mp"
    assert [parallel.stage_layers(30, stage) for stage in (0, 1)] == [range(0, 12), range(12, 30)]
    assert EngineArgs().executor_backend == "uni" and EngineArgs(pipeline_parallel_size=2).executor_backend == "mp"


def test_default_layer_split_gives_the_first_stages_the_extra_layers():
    config = ParallelConfig(pipeline_parallel_size=4)
    assert [len(config.stage_layers(30, s)) for s in range(4)] == [8, 8, 7, 7]
    assert ParallelConfig(pipeline_parallel_size=2).stage_layers(30, 1) == range(15, 30)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be at least 1"),
    (dict(tensor_parallel_size=3, nnodes=2), "do not divide evenly over 2 nodes"),
    (dict(nnodes=2, node_rank=2), "node_rank must be in"),
    (dict(pipeline_parallel_size=2, pp_layer_partition="30"), "one positive layer count per pipeline stage"),
    (dict(pp_layer_partition="a,b"), "comma-separated layer counts"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "--distributed-executor-backend mp"),
    (dict(tensor_parallel_size=2, disaggregation_mode="prefill"), "cannot be combined"),
])
def test_bad_parallel_flags_are_refused(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        EngineArgs(**kwargs)


def test_a_partition_must_cover_the_model():
    with pytest.raises(InvalidRequestError, match="covers 25 layers but the model has 30"):
        ParallelConfig(pipeline_parallel_size=2, pp_layer_partition=parse_layer_partition("10,15")).stage_layers(30, 0)


def test_torchrun_environment_makes_one_chunkserve_process_per_node(monkeypatch):
    for key, value in {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "GROUP_RANK": "1", "WORLD_SIZE": "2",
                       "GROUP_WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "10.0.0.2",
                       "MASTER_PORT": "29700"}.items():
        monkeypatch.setenv(key, value)
    engine, server = apply_torchrun_env(EngineArgs(tensor_parallel_size=2), ServerArgs())
    assert (engine.nnodes, engine.node_rank, engine.master_addr, engine.master_port) == (2, 1, "10.0.0.2", 29700)
    assert server.headless
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(InvalidRequestError, match="--nproc-per-node 1"):
        apply_torchrun_env(EngineArgs(), ServerArgs())


def test_headless_on_node_0_is_refused():
    from chunkserve.executor.launch import run_headless

    with pytest.raises(InvalidRequestError, match="--node-rank 1 or more"):
        run_headless(EngineArgs(tensor_parallel_size=2, nnodes=2))

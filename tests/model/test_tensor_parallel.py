"""Tensor and pipeline parallelism: the ranks run as real processes over gloo, each holding
its shard of a tiny random model, and the logits of a mixed batch (chunked prompts with
other requests' decodes) equal the unsharded model's and transformers'. GGUF block shards
dequantize to the matching slices of the float weights, and the C++ kernel reading them
gives the unsharded model's logits."""

from __future__ import annotations

import dataclasses
import os

import gguf
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from chunkserve.bench.service import free_port
from chunkserve.config.model import resolve_model
from chunkserve.config.parallel import ParallelConfig
from chunkserve.core.messages import ScheduledRequest
from chunkserve.errors import InvalidRequestError
from chunkserve.model.llama import Linear, LlamaModel
from chunkserve.model.loader import load_model, load_model_config
from chunkserve.model.parallel import ParallelContext, block_columns, block_rows
from chunkserve.ops.cpp_ops import build_cpp_ops, cpp_ops_for
from chunkserve.ops.model_ops import TORCH_OPS, BlockWeight
from chunkserve.worker.input_batch import build_forward_batch
from chunkserve.worker.kv_cache import allocate_kv_cache
from tests.conftest import has_cxx_compiler
from tests.model.gguf_files import write_gguf
from tests.paged_runner import reference_logits

ATOL = 1e-4
BLOCK_SIZE = 16
VOCAB = 251  # odd: the second TP rank's vocabulary shard is one row short, its logits padded

# Each request's whole token list, and the steps: how many tokens of which request each runs.
# Decodes (one token) share steps with prompt chunks.
_rng = np.random.default_rng(0)
TOKENS = {name: _rng.integers(0, VOCAB, length).tolist() for name, length in (("a", 23), ("b", 17), ("c", 40))}
SCHEDULE = [{"a": 20, "b": 7}, {"a": 1, "b": 7, "c": 16}, {"a": 1, "b": 1, "c": 16}, {"a": 1, "b": 1, "c": 8},
            {"b": 1}]


def tiny_config(arch: str, num_kv_heads: int):
    """3 layers (2 + 1 over two pipeline stages); 4 heads of 16: one TP rank's q heads are 32
    columns of o_proj, one GGUF block."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    shape = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=num_kv_heads, max_position_embeddings=256, initializer_range=0.15)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if arch == "llama":
        return LlamaConfig(**shape, rope_parameters=rope, tie_word_embeddings=False)
    if arch == "qwen2":  # q/k/v biases, the LM head tied to the embedding
        return Qwen2Config(**shape, rope_parameters=rope, tie_word_embeddings=True)
    return Qwen3Config(**shape, head_dim=16, rope_parameters=rope, tie_word_embeddings=False)  # q/k norms


MODELS = {"llama-2kv": ("llama", 2), "qwen2-1kv-tied": ("qwen2", 1), "qwen3-2kv": ("qwen3", 2)}


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    from transformers import AutoModelForCausalLM

    folders = {}
    for name, (arch, num_kv_heads) in MODELS.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(arch, num_kv_heads), dtype=torch.float32)
        folders[name] = str(tmp_path_factory.mktemp(name))
        model.save_pretrained(folders[name])
    # the llama's weights as a GGUF of Q8_0 matrices without output.weight, so that the LM head
    # reads the embedding's blocks: another model, the same for the sharded and the unsharded load
    folders["gguf-q8-tied"] = write_gguf(folders["llama-2kv"], str(tmp_path_factory.mktemp("gguf") / "tiny.gguf"),
                                         "Q8_0", with_lm_head=False)
    return folders


def drive(model: LlamaModel, cpp_ops=None) -> dict[str, torch.Tensor] | None:
    """Run SCHEDULE over a paged KV cache with scattered block tables; each request's logits
    at every position, on the rank that gathers them (None on the others). A pipeline stage
    takes its input from the previous stage and hands its output to the next, as the
    workers do."""
    model.set_ops(TORCH_OPS if cpp_ops is None else cpp_ops.model_ops())
    kernels = None if cpp_ops is None else cpp_ops.attention_kernels()
    parallel = model.parallel
    kv = allocate_kv_cache(model.parallel.kv_config(model.config), torch.float32, 32, BLOCK_SIZE)
    free = iter(np.random.default_rng(1).permutation(32).tolist())
    tables = {name: np.asarray([next(free) for _ in range(-(-len(tokens) // BLOCK_SIZE))], dtype=np.int64)
              for name, tokens in TOKENS.items()}
    computed, rows = dict.fromkeys(TOKENS, 0), {name: [] for name in TOKENS}
    for work in SCHEDULE:
        scheduled = [ScheduledRequest(name, computed[name], count, [], False, True, count == 1 and computed[name] > 0)
                     for name, count in work.items()]
        for name, count in work.items():
            computed[name] += count
        batch = build_forward_batch(scheduled, TOKENS, tables, BLOCK_SIZE, kernels)
        with torch.inference_mode():
            intermediate = None
            if not parallel.is_first_stage:
                shape = (len(batch.input_ids), model.config.hidden_size)
                intermediate = tuple(parallel.recv_from_prev_stage([shape, shape], torch.float32))
            out = model(batch.input_ids, batch.positions, kv, batch.attn, intermediate)
            if not parallel.is_last_stage:
                parallel.send_to_next_stage(list(out))
                continue
            logits = model.compute_logits(out)
        if logits is None:  # another TP rank gathers them
            continue
        row = 0
        for s in sorted(scheduled, key=lambda s: s.num_scheduled_tokens > 1):  # the batch's order: decodes first
            rows[s.request_id].append(logits[row : row + s.num_scheduled_tokens])
            row += s.num_scheduled_tokens
    gathers = parallel.is_last_stage and parallel.tp_rank == 0
    return {name: torch.cat(parts) for name, parts in rows.items()} if gathers else None


def load_rank(model_dir: str, rank: int, tp: int, pp: int) -> LlamaModel:
    source = resolve_model(model_dir)
    config = load_model_config(source)
    split = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    return load_model(source, config, "float32", 256, ParallelContext.from_world(rank, split, config.num_layers))


def _rank_main(rank: int, world_size: int, port: int, jobs: list[tuple], out_dir: str) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's few cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        for index, (model_dir, tp, pp, backend) in enumerate(jobs):
            logits = drive(load_rank(model_dir, rank, tp, pp), cpp_ops_for(backend))
            if logits is not None:
                torch.save(logits, os.path.join(out_dir, f"{index}-{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_world(world_size: int, jobs: list[tuple], out_dir) -> list[dict[str, torch.Tensor]]:
    """Run `jobs` (model folder, tp, pp, op backend), one after another, on `world_size` rank
    processes; the logits each gathered, from the one rank that gathered them."""
    port = free_port()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")  # read by the ranks' OpenMP (the C++ ops) as they start
        mp.spawn(_rank_main, args=(world_size, port, jobs, str(out_dir)), nprocs=world_size)
    results = []
    for index, (_, tp, pp, _) in enumerate(jobs):
        (path,) = out_dir.glob(f"{index}-*.pt")
        assert path.name == f"{index}-{(pp - 1) * tp}.pt", "the last stage's first TP rank gathers the logits"
        results.append(torch.load(path))
    return results


TWO_RANK_JOBS = [("llama-2kv", 2, 1, "torch"), ("qwen2-1kv-tied", 2, 1, "torch"), ("qwen3-2kv", 2, 1, "torch"),
                 ("llama-2kv", 1, 2, "torch"), ("qwen2-1kv-tied", 1, 2, "torch"), ("llama-2kv", 2, 1, "cpp"),
                 ("gguf-q8-tied", 2, 1, "cpp")]
FOUR_RANK_JOBS = [("qwen2-1kv-tied", 2, 2, "torch")]


@pytest.fixture(scope="module")
def sharded_logits(model_dirs, tmp_path_factory) -> dict[tuple, dict[str, torch.Tensor]]:
    """Every job's gathered logits (a cpp job wherever a C++ compiler exists, as the `cpp_ops`
    fixture: there the ops must build, or this fails): one world of two ranks runs its jobs one
    after another, then one of four ranks (starting the processes costs more than the jobs)."""
    has_cpp = has_cxx_compiler()
    if has_cpp:
        build_cpp_ops()  # here once (a failed build raises), so that the ranks only load it
    results = {}
    for world_size, jobs in ((2, TWO_RANK_JOBS), (4, FOUR_RANK_JOBS)):
        runnable = [job for job in jobs if job[3] != "cpp" or has_cpp]
        got = run_world(world_size, [(model_dirs[job[0]], *job[1:]) for job in runnable],
                        tmp_path_factory.mktemp(f"world{world_size}"))
        results.update(zip(runnable, got))
    return results


@pytest.mark.parametrize("job", TWO_RANK_JOBS + FOUR_RANK_JOBS,
                         ids=[f"{model}-tp{tp}-pp{pp}-{ops}" for model, tp, pp, ops in TWO_RANK_JOBS + FOUR_RANK_JOBS])
def test_sharded_logits_equal_the_unsharded_models_and_transformers(job, sharded_logits, model_dirs):
    from transformers import AutoModelForCausalLM

    model_name, _, _, backend = job
    got = sharded_logits.get(job)
    if got is None:
        pytest.skip("no C++ compiler on this machine; the engine falls back to plain torch")
    source = resolve_model(model_dirs[model_name])
    unsharded = drive(load_model(source, load_model_config(source), "float32", 256), cpp_ops_for(backend))
    reference = None
    if source.kind == "hf":  # the GGUF's weights are quantized: only the unsharded load is its reference
        reference = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
    for name, tokens in TOKENS.items():
        torch.testing.assert_close(got[name], unsharded[name], atol=ATOL, rtol=1e-4)
        if reference is not None:
            torch.testing.assert_close(got[name], reference_logits(reference, tokens), atol=ATOL, rtol=1e-4)


def test_a_rank_holds_and_loads_only_its_shard(model_dirs):
    """The second TP rank of the second stage: no embedding, its layer (global 2, local 0),
    the rows of its heads and MLP share, the (tied) LM head's last vocabulary rows; the
    checkpoint's other layers are neither read nor needed, and a missing weight of its own
    is an error."""
    from safetensors.torch import load_file

    source = resolve_model(model_dirs["qwen2-1kv-tied"])
    config = load_model_config(source)
    weights = load_file(os.path.join(source.path, "model.safetensors"))
    parallel = ParallelContext(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2, layers=range(2, 3))
    model = load_model(source, config, "float32", 256, parallel)
    kv_config = parallel.kv_config(config)
    assert model.embed_tokens is None and len(model.layers) == 1 and kv_config.num_layers == 1
    assert kv_config.num_kv_heads == 1  # the one KV head, replicated
    attention, mlp = model.layers[0].self_attn, model.layers[0].mlp
    q, k = weights["model.layers.2.self_attn.q_proj.weight"], weights["model.layers.2.self_attn.k_proj.weight"]
    v = weights["model.layers.2.self_attn.v_proj.weight"]
    assert torch.equal(attention.qkv_proj.weight, torch.cat([q[32:], k, v]))
    assert torch.equal(attention.o_proj.weight, weights["model.layers.2.self_attn.o_proj.weight"][:, 32:])
    gate, up = weights["model.layers.2.mlp.gate_proj.weight"], weights["model.layers.2.mlp.up_proj.weight"]
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([gate[64:], up[64:]]))
    assert torch.equal(mlp.down_proj.weight, weights["model.layers.2.mlp.down_proj.weight"][:, 64:])
    assert torch.equal(model.lm_head.weight, weights["model.embed_tokens.weight"][126:])

    own = {name: tensor for name, tensor in weights.items() if model.uses_weight(name)}
    assert not any(name.startswith(("model.layers.0.", "model.layers.1.")) for name in own)
    own.pop("model.layers.2.mlp.up_proj.weight")
    with torch.device("meta"):
        fresh = LlamaModel(config, 256, parallel)
    with pytest.raises(KeyError, match="up_proj"):
        fresh.to_empty(device="cpu").load_hf_weights(own)


def test_shapes_that_do_not_split_are_refused(model_dirs):
    config = load_model_config(resolve_model(model_dirs["llama-2kv"]))
    ParallelConfig(tensor_parallel_size=2).check_model(config)
    ParallelConfig(tensor_parallel_size=4).check_model(config)  # 2 KV heads, each replicated on 2 ranks
    for bad, message in ((dataclasses.replace(config, intermediate_size=129), "intermediate size"),
                         (dataclasses.replace(config, num_kv_heads=3), "key/value heads"),
                         (dataclasses.replace(config, num_heads=5), "attention heads")):
        with pytest.raises(InvalidRequestError, match=message):
            ParallelConfig(tensor_parallel_size=2).check_model(bad)
    with pytest.raises(InvalidRequestError, match="cannot fill"):
        ParallelConfig(pipeline_parallel_size=4).check_model(config)  # 3 layers


def quantized(weight: torch.Tensor, type_name: str) -> tuple[BlockWeight, torch.Tensor]:
    """The weight as GGUF blocks, and their exact dequantization."""
    ggml_type = gguf.GGMLQuantizationType[type_name]
    blocks = gguf.quants.quantize(weight.numpy(), ggml_type)
    floats = torch.from_numpy(gguf.quants.dequantize(blocks, ggml_type))
    return BlockWeight(int(ggml_type), torch.from_numpy(blocks)), floats


def dequantized(blocks: BlockWeight) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(blocks.blocks.numpy(), blocks.ggml_type))


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_block_shards_dequantize_to_the_float_shards(type_name):
    blocks, floats = quantized(torch.randn(48, 128, generator=torch.Generator().manual_seed(0)), type_name)
    assert torch.equal(dequantized(block_rows(blocks, range(16, 40))), floats[16:40])
    assert torch.equal(dequantized(block_columns(blocks, 128, range(32, 96))), floats[:, 32:96])
    assert torch.equal(dequantized(block_columns(blocks, 128, range(0, 128))), floats)
    assert block_columns(blocks, 128, range(16, 80)) is None  # not on block boundaries: the float weight serves


@pytest.mark.parametrize("tp", [2, 4])
def test_a_rank_keeps_the_blocks_of_its_shards(model_dirs, tp):
    """Loaded from Q8_0 blocks, a TP rank's linears keep blocks that dequantize to its float
    shards (the q/k/v and gate/up parts stacked); at tp 4 a rank's one head is 16 columns of
    o_proj, half a block, so o_proj drops its blocks."""
    from safetensors.torch import load_file

    source = resolve_model(model_dirs["qwen2-1kv-tied"])
    config = load_model_config(source)
    weights, blocks = {}, {}
    for name, tensor in load_file(os.path.join(source.path, "model.safetensors")).items():
        if tensor.dim() == 2:
            blocks[name], tensor = quantized(tensor, "Q8_0")
        weights[name] = tensor
    with torch.device("meta"):
        model = LlamaModel(config, 256, ParallelContext(tp_rank=tp - 1, tp_size=tp))
    model.to_empty(device="cpu").load_hf_weights(weights, blocks)
    layer = model.layers[1]
    assert (layer.self_attn.o_proj.blocks is None) == (tp == 4)
    for linear in [m for m in model.modules() if isinstance(m, Linear) and m.blocks is not None]:
        assert torch.equal(dequantized(linear.blocks), linear.weight)
    head = model.vocab_rows
    assert torch.equal(dequantized(model.embedding_blocks), model.embed_tokens.weight[head.start : head.stop])

"""Deterministic mode end to end (`LLM(deterministic=True)`): each request's tokens and logprobs
have the same bits under every chunking of its prompt (token budgets 1 to 512, no chunking, a
chunk schedule, a TBT SLO), with or without a prefix-cache hit, after a preemption, with
speculative verification and in any arrival order, greedy and seeded, in bfloat16 mode (the
default dtype where the CPU has it) and in float32."""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import pytest

from chunkserve import LLM, SamplingParams
from chunkserve.config.cpu import native_bf16
from tests.engine.support import assert_pool_free
from tests.engine.tiny_llm_support import TINY, build_llm

MAX_MODEL_LEN = 512
PROMPT_LENGTHS = (1, 17, 40, 100, 257, 300, 5, 64)
SHARED_PREFIX = 48  # three blocks of 16
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5)
SEEDED = SamplingParams(max_tokens=12, temperature=0.8, seed=7, ignore_eos=True, logprobs=5)
CONFIGURATIONS = {
    "budget 1": dict(max_num_batched_tokens=1, block_size=1, max_num_seqs=1),  # a budget holds a block and the decodes
    "budget 16": dict(max_num_batched_tokens=16),
    "budget 48": dict(max_num_batched_tokens=48),
    "budget 512": dict(max_num_batched_tokens=512),
    "no chunking": dict(enable_chunked_prefill=False),
    "chunk schedule": dict(max_num_batched_tokens=256, chunk_schedule="256:64:4:256"),
    "tbt slo": dict(max_num_batched_tokens=256, tbt_slo_ms=60),
    "preempted": dict(max_num_batched_tokens=64, num_kv_blocks=40),
    # the tiny model drafts for itself: every step verifies 3 drafts (random text gives n-grams none)
    "speculative": dict(max_num_batched_tokens=64, speculative_config={
        "method": "draft_model", "model": "{tiny_gguf}", "num_speculative_tokens": 3, "policy": "always"}),
}
# float32 runs the configurations that change the most: row counts, recomputes, verification rows
FLOAT32_CONFIGURATIONS = ("budget 1", "preempted", "speculative")
NEEDS_BF16 = pytest.mark.skipif(not native_bf16(), reason="bfloat16 mode needs native bfloat16")
DTYPES = [pytest.param("bfloat16", marks=NEEDS_BF16), "float32"]
CASES = [*(pytest.param("bfloat16", name, marks=NEEDS_BF16, id=f"bfloat16-{name}") for name in CONFIGURATIONS),
         *(pytest.param("float32", name, id=f"float32-{name}") for name in FLOAT32_CONFIGURATIONS)]


def signature(outputs) -> list[tuple]:
    """Per request: its tokens and every logprob returned, as exact floats."""
    return [(tuple(o.outputs[0].token_ids),
             tuple(tuple(sorted((token, entry.logprob) for token, entry in step.items()))
                   for step in o.outputs[0].logprobs)) for o in outputs]


def deterministic_llm(tiny_gguf: str, dtype: str, **engine_args) -> LLM:
    engine_args.setdefault("enable_prefix_caching", False)
    return build_llm(TINY, tiny_gguf, MAX_MODEL_LEN, dtype=dtype, deterministic=True, **engine_args)


@pytest.fixture(scope="module")
def prompts(tiny_gguf) -> list[list[int]]:
    """Random prompts of mixed lengths; those long enough share their first three blocks."""
    rng = np.random.default_rng(7)
    shared = rng.integers(0, 49152, SHARED_PREFIX).tolist()
    prompts = [rng.integers(0, 49152, n).tolist() for n in PROMPT_LENGTHS]
    return [shared + p[SHARED_PREFIX:] if len(p) > SHARED_PREFIX else p for p in prompts]


@pytest.fixture(scope="module")
def reference(tiny_gguf, prompts) -> Callable[[str], list[tuple]]:
    """Per dtype (computed once): every prompt greedy and seeded, on a budget-64 engine without
    prefix caching."""

    @functools.cache
    def signature_for(dtype: str) -> list[tuple]:
        llm = deterministic_llm(tiny_gguf, dtype, max_num_batched_tokens=64)
        return signature(llm.generate(prompts * 2, [GREEDY] * len(prompts) + [SEEDED] * len(prompts),
                                      use_tqdm=False))

    return signature_for


@pytest.mark.parametrize("dtype, name", CASES)
def test_the_same_bits_under_every_chunking_preemption_and_verification(reference, tiny_gguf, prompts, dtype, name):
    expected = reference(dtype)
    engine_args = dict(CONFIGURATIONS[name])
    if "speculative_config" in engine_args:
        engine_args["speculative_config"] = {**engine_args["speculative_config"], "model": tiny_gguf}
    llm = deterministic_llm(tiny_gguf, dtype, **engine_args)
    outputs = llm.generate(prompts * 2, [GREEDY] * len(prompts) + [SEEDED] * len(prompts), use_tqdm=False)
    assert signature(outputs) == expected
    records = llm.get_step_records()
    if name == "preempted":
        assert sum(r.num_preemptions for r in records) > 0
    if name == "speculative":
        assert sum(r.num_draft_tokens for r in records) > 0
    assert_pool_free(llm)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prefix_cache_hit_and_the_arrival_order_change_no_bit(reference, tiny_gguf, prompts, dtype):
    expected = reference(dtype)
    llm = deterministic_llm(tiny_gguf, dtype, max_num_batched_tokens=48, enable_prefix_caching=True)
    warm = [p[:SHARED_PREFIX] + [1, 2, 3] for p in prompts if len(p) > SHARED_PREFIX]
    llm.generate(warm, SamplingParams(max_tokens=2), use_tqdm=False)
    order = list(reversed(range(len(prompts))))
    outputs = llm.generate([prompts[i] for i in order] * 2,
                           [GREEDY] * len(prompts) + [SEEDED] * len(prompts), use_tqdm=False)
    assert sum(o.num_cached_tokens for o in outputs) >= SHARED_PREFIX * len(warm)
    got = signature(outputs)
    n = len(prompts)
    assert [got[order.index(i)] for i in range(n)] == expected[:n]
    assert [got[n + order.index(i)] for i in range(n)] == expected[n:]


@pytest.mark.parametrize("dtype", DTYPES)
def test_blocks_loaded_from_the_disk_tier_change_no_bit(reference, tiny_gguf, prompts, tmp_path, dtype):
    """A second engine on the first one's disk tier loads the prompts' blocks from its files."""
    expected = reference(dtype)
    tier = dict(enable_prefix_caching=True, enable_hierarchical_cache=True, hicache_storage_dir=str(tmp_path),
                hicache_write_policy="write_through", max_num_batched_tokens=48)
    first = deterministic_llm(tiny_gguf, dtype, **tier)
    first.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    first.engine.shutdown()
    second = deterministic_llm(tiny_gguf, dtype, **tier)
    outputs = second.generate(prompts * 2, [GREEDY] * len(prompts) + [SEEDED] * len(prompts), use_tqdm=False)
    assert sum(o.num_cached_tokens for o in outputs[:len(prompts)]) >= 16 * sum(len(p) // 16 for p in prompts) - 16
    assert signature(outputs) == expected


@pytest.mark.slow  # rank processes: the default tier checks the fixed-order all-reduce (tests/model)
@pytest.mark.parametrize("parallel", [dict(pipeline_parallel_size=2), dict(tensor_parallel_size=2)],
                         ids=["pp2", "tp2"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pipeline_stages_keep_the_bits_and_tensor_parallel_ranks_keep_theirs(reference, tiny_gguf, prompts,
                                                                             parallel, dtype):
    """PP: the monolithic engine's bits, its micro-batches cut otherwise. TP: the same bits under
    any chunking at one TP size (not the monolithic engine's: the ranks' partial sums add up in
    another order)."""
    expected = reference(dtype)
    params = [GREEDY] * len(prompts) + [SEEDED] * len(prompts)
    signatures = []
    for budget in (16, 128):
        llm = deterministic_llm(tiny_gguf, dtype, max_num_batched_tokens=budget, **parallel)
        try:
            signatures.append(signature(llm.generate(prompts * 2, params, use_tqdm=False)))
        finally:
            llm.engine.shutdown()
    assert signatures[0] == signatures[1]
    if "pipeline_parallel_size" in parallel:
        assert signatures[0] == expected

"""Prefix caching on the tiny model (behaviour: no real weights needed): greedy outputs do not
change, and a shared prefix is computed once."""

from __future__ import annotations

import random

import pytest

from chunkserve import LLM, SamplingParams
from tests.engine.tiny_llm_support import TINY, build_llm

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SYSTEM = ("You are a patient tutor. Answer in plain words, give one example, and end with a short "
          "question that checks the student understood. ") * 6


def conversations(llm: LLM) -> list[list[int]]:
    """Chats sharing a long system prompt, and a multi-turn chat resent with its history."""
    questions = ["What is a prime number?", "Why is the sea salty?", "How do plants eat?",
                 "What is gravity?", "Why do we sleep?"]
    prompts = [llm.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
               for q in questions]
    history = [{"role": "system", "content": SYSTEM}]
    for turn, question in enumerate(questions[:3]):
        history.append({"role": "user", "content": question})
        prompts.append(llm.apply_chat_template(history))
        history.append({"role": "assistant", "content": f"Answer number {turn}: it depends on the details."})
    return prompts


def generate_in_waves(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Half the prompts at once, then the rest, so the second wave can hit the first's blocks."""
    half = len(prompts) // 2
    outputs = llm.generate(prompts[:half], PARAMS, use_tqdm=False) + llm.generate(prompts[half:], PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def tiny(tiny_gguf) -> LLM:
    return build_llm(TINY, tiny_gguf, max_num_batched_tokens=64, max_num_seqs=32)


@pytest.fixture(scope="module")
def uncached(tiny_gguf):
    """Reference outputs with caching off."""
    llm = build_llm(TINY, tiny_gguf, max_num_batched_tokens=512, enable_prefix_caching=False)
    prompts = conversations(llm)
    outputs = generate_in_waves(llm, prompts)
    assert sum(r.prefix_cache_hits for r in llm.get_step_records()) == 0
    return prompts, outputs


@pytest.mark.parametrize("engine_args", [
    dict(max_num_batched_tokens=16, max_num_seqs=16),
    dict(max_num_batched_tokens=512),
    # (a KV pool must hold max_model_len: 256 tokens hold the longest chat and its 8 tokens)
    dict(num_kv_blocks=16, block_size=16, max_num_batched_tokens=64, tiny_max_model_len=256),
], ids=["budget16", "budget512", "tiny-pool"])
def test_greedy_outputs_are_the_same_with_caching_on_and_off(tiny_gguf, uncached, engine_args):
    prompts, expected = uncached
    llm = build_llm(TINY, tiny_gguf, **engine_args)
    assert generate_in_waves(llm, prompts) == expected
    records = llm.get_step_records()
    hits = sum(r.prefix_cache_hits for r in records)
    assert 0 < hits < sum(len(p) for p in prompts)
    assert sum(r.prefix_cache_queries for r in records) == sum(len(p) for p in prompts)  # first admissions only
    if "num_kv_blocks" in engine_args:
        assert sum(r.num_preemptions for r in records) > 0, "the pool was not small enough to preempt"
    else:  # every prompt token is either found in the cache or computed, once
        assert sum(r.num_prefill_tokens for r in records) == sum(r.prefix_cache_queries for r in records) - hits
    kv = llm.engine.engine_core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks, "KV blocks leaked"


def test_a_shared_512_token_prefix_is_computed_once(tiny):
    rng = random.Random(512)
    prefix = [rng.randrange(100, 40000) for _ in range(512)]
    first = tiny.generate(prefix + [rng.randrange(100, 40000) for _ in range(20)], PARAMS, use_tqdm=False)[0]
    before = len(tiny.get_step_records())
    suffix = [rng.randrange(100, 40000) for _ in range(37)]
    second = tiny.generate(prefix + suffix, PARAMS, use_tqdm=False)[0]
    records = tiny.get_step_records()[before:]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 512
    assert sum(r.num_prefill_tokens for r in records) == 37
    assert records[0].prefix_cache_hits == 512 and records[0].prefix_cache_queries == 549

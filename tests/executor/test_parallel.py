"""Tensor and pipeline parallelism end to end through the offline API: real worker processes
(one per rank) joined by torch.distributed (gloo). TP 2 on tiny random Llama models against
TP 1 and transformers (logprobs, fp32 tolerance) under chunk budgets, mixed batches, a
prefix-cache hit and preemption; PP 2 on the default SmolLM2 model against TP 1 with the
micro-batches' order read from the step records; what vLLM refuses, refused the same way."""

from __future__ import annotations

import pytest
import torch

from chunkserve import LLM, InvalidRequestError, SamplingParams
from tests.engine.support import assert_pool_free
from tests.executor.support import STORY, assert_same, prompts_of, tiny_llama

TOL = 1e-4
HF_TOL = 2e-3  # transformers' attention sums in another order over the whole sequence


@pytest.fixture(scope="module", params=[2, 1], ids=["2-kv-heads", "1-kv-head-replicated"])
def tiny_dir(request, tmp_path_factory, default_tokenizer):
    return tiny_llama(tmp_path_factory.mktemp(f"tiny-kv{request.param}"), default_tokenizer, request.param)


def prefix_hit_prompt(tokenizer) -> list[int]:
    """Sent after prompts_of's: its first 64 tokens are cached by then."""
    ids = tokenizer.encode(STORY)
    return ids[:64] + ids[120:140]


def run(llm: LLM, prompts, max_tokens: int = 12):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=5, ignore_eos=True)
    return llm.generate(prompts, params, use_tqdm=False)


def hf_logprobs(model_dir: str, prompt: list[int], tokens: list[int]) -> list[float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    rows = logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)].log_softmax(-1)
    return [rows[i, t].item() for i, t in enumerate(tokens)]


# budget 16 (many chunks, mixed steps) in every tier; 64 and 512 (whole prompts) in the long tier (CI runs both)
@pytest.mark.parametrize("budget", [16, pytest.param(64, marks=pytest.mark.slow), pytest.param(512, marks=pytest.mark.slow)])
def test_tp2_equals_tp1_and_transformers(tiny_dir, default_tokenizer, budget):
    prompts = prompts_of(default_tokenizer)
    common = dict(max_num_batched_tokens=budget, max_num_seqs=16, num_kv_blocks=256, block_size=4)
    tp1 = LLM(tiny_dir, dtype="float32", **common)
    expected = run(tp1, prompts) + run(tp1, [prefix_hit_prompt(default_tokenizer)])
    tp = LLM(tiny_dir, dtype="float32", tensor_parallel_size=2, **common)
    try:
        got = run(tp, prompts) + run(tp, [prefix_hit_prompt(default_tokenizer)])
        assert_same(got, expected, TOL)
        assert got[-1].num_cached_tokens >= 64, "the shared prefix was not found in the prefix cache"
        records = tp.engine.step_records
        assert any(r.forward_mode.value == "MIXED" for r in records), "no mixed step"
        ranks = {r["rank"] for record in records for r in record.ranks}
        assert ranks == {0, 1} and all(r["comm_ops"] > 0 and r["comm_bytes"] > 0 for rec in records
                                       for r in rec.ranks)
        for prompt, output in zip(prompts, got):
            tokens = output.outputs[0].token_ids
            assert [lps[t].logprob for t, lps in zip(tokens, output.outputs[0].logprobs)] == pytest.approx(
                hf_logprobs(tiny_dir, prompt, tokens), abs=HF_TOL)
        assert_pool_free(tp)
    finally:
        tp.engine.shutdown()


def test_tp2_under_forced_preemption_equals_tp1(tiny_dir, default_tokenizer):
    prompts = prompts_of(default_tokenizer)[:5]  # 307 prompt tokens + 200 outputs in a pool of 224 tokens
    common = dict(max_num_batched_tokens=64, max_num_seqs=16, num_kv_blocks=56, block_size=4,
                  enable_prefix_caching=False)
    expected = run(LLM(tiny_dir, dtype="float32", **common), prompts, max_tokens=40)
    tp = LLM(tiny_dir, dtype="float32", tensor_parallel_size=2, **common)
    try:
        got = run(tp, prompts, max_tokens=40)
        assert sum(r.num_preemptions for r in tp.engine.step_records) > 0, "the small pool was meant to preempt"
        assert_same(got, expected, TOL)
        assert_pool_free(tp)
    finally:
        tp.engine.shutdown()


@pytest.mark.slow
def test_pp2_greedy_tokens_equal_tp1_with_chunks_in_consecutive_micro_batches(default_llm):
    tokenizer = default_llm.get_tokenizer()
    questions = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
                 "Why is the sky blue?", "Name a famous painter.", "What is 12 times 12?",
                 "Describe a cat in one sentence.", "Give me a synonym for happy."]
    prompts = [default_llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    prompts.append(tokenizer.encode("Once upon a time, in a land far away, " * 40))  # a long prompt: many chunks
    params = SamplingParams(max_tokens=32, temperature=0.0)
    expected = [o.outputs[0].token_ids for o in default_llm.generate(prompts, params, use_tqdm=False)]
    pp = LLM(dtype="float32",
             pipeline_parallel_size=2, max_num_batched_tokens=64, kv_cache_memory_gb=0.25, max_num_seqs=32)
    try:
        got = [o.outputs[0].token_ids for o in pp.generate(prompts, params, use_tqdm=False)]
        assert got == expected
        records = list(pp.engine.step_records)
        assert all(r.request_ids for r in records)
        for index, record in enumerate(records):  # a request whose step samples is in no other step in flight
            end = record.start_time + record.duration_s
            for other in records[index + 1:]:
                if other.start_time >= end:
                    break
                assert not set(record.sampled_request_ids) & set(other.request_ids), (
                    f"step {other.step_id} computed a request still waiting for its token from step {record.step_id}")
        # Not a race with the host's speed: the pipelined core submits the next step before it waits
        # for the oldest (EngineCore._step_pipelined), so two consecutive records overlap unless nothing
        # else could be scheduled while the first was in flight.
        overlapping = sum(1 for a, b in zip(records, records[1:]) if b.start_time < a.start_time + a.duration_s)
        assert overlapping > len(records) // 2, "the pipeline never held two steps at once"
        long_id = pp_request_id_of_longest(records)
        steps = [r.step_id for r in records if long_id in r.request_ids and long_id not in r.sampled_request_ids]
        assert len(steps) >= 5 and steps == list(range(steps[0], steps[0] + len(steps))), steps
        assert {r["rank"] for record in records for r in record.ranks} == {0, 1}
        assert_pool_free(pp)
    finally:
        pp.engine.shutdown()


def pp_request_id_of_longest(records) -> str:
    """The request computed in the most steps without sampling: the long prompt's chunks."""
    counts: dict[str, int] = {}
    for record in records:
        for request_id in set(record.request_ids) - set(record.sampled_request_ids):
            counts[request_id] = counts.get(request_id, 0) + 1
    return max(counts, key=counts.get)


def test_tp2_on_smollm2_is_refused_at_start_up_with_vllms_message():
    with pytest.raises(InvalidRequestError, match=r"Total number of attention heads \(9\) must be divisible by "
                                                  r"tensor parallel size \(2\)"):
        LLM(dtype="float32", tensor_parallel_size=2)


def test_uni_executor_refuses_several_ranks():
    with pytest.raises(InvalidRequestError, match="distributed-executor-backend mp"):
        LLM(dtype="float32", tensor_parallel_size=3, distributed_executor_backend="uni")


@pytest.mark.slow
def test_tp3_on_smollm2_equals_tp1(default_llm):
    prompts = [default_llm.apply_chat_template([{"role": "user", "content": q}])
               for q in ["What is the capital of France?", "Write a haiku about the sea."]]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    expected = [o.outputs[0].token_ids for o in default_llm.generate(prompts, params, use_tqdm=False)]
    tp = LLM(dtype="float32", tensor_parallel_size=3, max_num_batched_tokens=64, kv_cache_memory_gb=0.25)
    try:
        assert [o.outputs[0].token_ids for o in tp.generate(prompts, params, use_tqdm=False)] == expected
    finally:
        tp.engine.shutdown()


def test_pp2_with_a_tbt_slo_profiles_each_stage_and_sizes_micro_batches(tmp_path, default_tokenizer):
    """The start-up profile runs through both stages (so every micro-batch has a prediction), and
    SLO-sized micro-batches give TP 1's outputs."""
    model = tiny_llama(tmp_path, default_tokenizer, 2)
    prompts = prompts_of(default_tokenizer)
    common = dict(max_num_batched_tokens=512, num_kv_blocks=256, block_size=4, tbt_slo_ms=500)
    expected = run(LLM(model, dtype="float32", **common), prompts)
    pp = LLM(model, dtype="float32", pipeline_parallel_size=2, **common)
    try:
        assert_same(run(pp, prompts), expected, TOL)
        records = list(pp.engine.step_records)
        assert all(r.predicted_duration_s is not None for r in records), "the profile did not seed the model"
        assert all(len(r.ranks) == 2 and all(x["p2p_s"] <= x["comm_s"] <= x["compute_s"] for x in r.ranks)
                   for r in records)
        assert_pool_free(pp)
    finally:
        pp.engine.shutdown()

"""Helpers shared by the tests of tests/executor/ (support, not a test module)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_hf_config


def tiny_llama(folder, tokenizer, num_kv_heads: int) -> str:
    from transformers import AutoModelForCausalLM

    config = tiny_hf_config("llama")
    config.num_key_value_heads = num_kv_heads
    config.vocab_size = len(tokenizer)
    config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(num_kv_heads)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def prompts_of(tokenizer) -> list[list[int]]:
    """Prompts of very different lengths (1 to 450 tokens), sent together: more than one step of
    the largest budget, so decodes and prompt chunks share steps (mixed)."""
    ids = tokenizer.encode(STORY)
    return [ids[:1], ids[3:20], ids[:150], ids[10:75], ids[:64] + ids[100:110], ids[200:650]]


def assert_same(got, expected, tol: float):
    for a, b in zip(got, expected):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):  # vLLM's dicts: the sampled token, the top k
            assert list(x) == list(y)
            assert [e.logprob for e in x.values()] == pytest.approx([e.logprob for e in y.values()], abs=tol)


STORY = ("The lighthouse keeper climbed the stairs each evening, counting steps and listening to the gulls "
         "over the grey water while the ships went by. ") * 20

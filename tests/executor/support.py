"""Helpers shared by the tests of tests/executor/ (support, not a test module)."""

from __future__ import annotations

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

"""A GGUF model's linears in deterministic mode: a request's logits are the same bits whether
its rows run alone or beside another request's chunk, across the row counts where a layer
switches from its blocks to its floats (float32) or to its packed bfloat16 weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chunkserve.config.model import resolve_model
from chunkserve.model.loader import load_model, load_model_config
from tests.paged_runner import PagedRunner


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_requests_logits_do_not_depend_on_the_chunk_beside_it(cpp_ops, tiny_gguf, dtype):
    if dtype == "bfloat16" and not cpp_ops.bf16_dot_supported():
        pytest.skip("deterministic bfloat16 mode needs AVX-512 with AVX512_BF16")
    source = resolve_model(tiny_gguf)
    config = load_model_config(source)
    alone, shared = (PagedRunner(load_model(source, config, dtype, 512), config, cpp_ops=cpp_ops, deterministic=True)
                     for _ in range(2))
    rng = np.random.default_rng(5)
    prompt, other = (rng.integers(0, config.vocab_size, n).tolist() for n in (9, 120))
    alone.add("p", prompt + [1, 2])
    shared.add("p", prompt + [1, 2])
    shared.add("o", other)
    assert torch.equal(alone.step({"p": len(prompt)})["p"], shared.step({"o": 100, "p": len(prompt)})["p"])
    # a decode row alone, and beside the other prompt's last 20 rows
    assert torch.equal(alone.step({"p": 1})["p"], shared.step({"p": 1, "o": 20})["p"])

"""Deterministic mode at the model (`--deterministic`: the linear and attention kernels of one
reduction order per output): a request's logits have the same bits whatever shares its steps
and however its tokens are cut into chunks, in float32 and in bfloat16 mode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chunkserve.config.cpu import native_bf16
from chunkserve.config.model import resolve_model
from chunkserve.model.loader import load_model, load_model_config
from tests.paged_runner import PagedRunner

PROMPT_LEN = 40
NUM_DECODES = 64
LONG_CHUNK = 256
DTYPES = ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(not native_bf16(),
                                                                        reason="bfloat16 mode needs native bfloat16"))]


@pytest.fixture(scope="module")
def tokens(tiny_gguf) -> dict[str, list[int]]:
    """The target request's tokens (prompt, then the tokens it decodes, teacher-forced), 31 step
    mates' prompts of assorted lengths, and a long prompt whose 256-token chunks share steps."""
    vocab = load_model_config(resolve_model(tiny_gguf)).vocab_size
    rng = np.random.default_rng(42)
    draw = lambda n: rng.integers(0, vocab, n).tolist()  # noqa: E731
    mates = {f"m{i}": draw(int(n) + NUM_DECODES) for i, n in enumerate(rng.integers(3, 300, 31))}
    return {"target": draw(PROMPT_LEN + NUM_DECODES), "long": draw(16 * LONG_CHUNK), **mates}


def target_rows(tiny_gguf, cpp_ops, dtype: str, tokens: dict[str, list[int]], cuts: list[int],
                mates: int = 0, long_chunks: bool = False) -> torch.Tensor:
    """The target's logits at every row that samples (its prompt's last, then each decode), its
    tokens computed in runs of `cuts` (then one token a step), each step shared with `mates`
    decoding mates and, with `long_chunks`, a 256-token chunk of the long prompt while it lasts."""
    source = resolve_model(tiny_gguf)
    config = load_model_config(source)
    runner = PagedRunner(load_model(source, config, dtype, 4096), config, num_blocks=1200, cpp_ops=cpp_ops,
                         deterministic=True)
    others = [f"m{i}" for i in range(mates)]
    for request_id in ["target", "long", *others]:
        runner.add(request_id, tokens[request_id])
    for request_id in others:  # the mates' prompts first, so they decode beside the target
        runner.step({request_id: len(tokens[request_id]) - NUM_DECODES})
    runs = cuts + [1] * (PROMPT_LEN + NUM_DECODES - 1 - sum(cuts))
    rows, long_done = [], 0
    for run in runs:
        work = {"target": run, **dict.fromkeys(others, 1)}
        if long_chunks and long_done < len(tokens["long"]):
            work["long"] = LONG_CHUNK
            long_done += LONG_CHUNK
        logits = runner.step(work)["target"]
        start = runner.computed["target"] - run
        rows += [logits[i] for i in range(run) if start + i + 1 >= PROMPT_LEN]  # rows that sample
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_requests_logits_do_not_depend_on_its_step_mates_or_its_chunks(tiny_gguf, cpp_ops, tokens, dtype):
    alone = target_rows(tiny_gguf, cpp_ops, dtype, tokens, [PROMPT_LEN])
    assert alone.shape[0] == NUM_DECODES
    variants = {
        **{f"beside {n} decodes": dict(cuts=[PROMPT_LEN], mates=n) for n in (1, 7, 31)},
        "beside a 256-token chunk": dict(cuts=[PROMPT_LEN], long_chunks=True),
        **{f"prompt in chunks of {size}": dict(cuts=[size] * (PROMPT_LEN // size) + [PROMPT_LEN % size] * bool(
            PROMPT_LEN % size)) for size in (1, 16)},
        "verification runs of 4": dict(cuts=[PROMPT_LEN] + [4] * 15),
        "recomputed after 20 decodes": dict(cuts=[PROMPT_LEN + 20], mates=7, long_chunks=True),
    }
    for name, variant in variants.items():
        rows = target_rows(tiny_gguf, cpp_ops, dtype, tokens, **variant)
        assert torch.equal(rows, alone), name

"""The sampler against transformers' logits processors and against the distributions it
should draw from: many rows of the same logits in one call are many independent draws."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from chunkserve import SamplingParams
from chunkserve.worker import sampler
from chunkserve.worker.sampler import SamplingState, sample

VOCAB = 12
DRAWS = 4000
EOS = 11


def state(params: SamplingParams, prompt: list[int] = (0,), output: list[int] = (), seed: int | None = None):
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingState(params, list(prompt) + list(output), len(prompt), EOS, generator)


def draw(logits: torch.Tensor, params: SamplingParams, count: int = DRAWS, seed: int = 0) -> torch.Tensor:
    """`count` independent samples of one row of logits, as token counts per vocabulary id."""
    tokens = sample(logits.repeat(count, 1), [state(params) for _ in range(count)], torch.Generator().manual_seed(seed))
    return torch.bincount(torch.tensor(tokens), minlength=VOCAB)


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.tensor([[2.0, 1.5, 1.2, 0.9, 0.5, 0.1, -0.3, -0.8, -1.5, -2.0, -3.0, -4.0]])


def expected_probs(logits: torch.Tensor, *warpers) -> torch.Tensor:
    scores = logits.clone()
    for warper in warpers:
        scores = warper(torch.zeros(1, 1, dtype=torch.long), scores)
    return scores.softmax(dim=-1)[0]


@pytest.mark.parametrize("fields, warpers", [
    (dict(temperature=1.0), []),
    (dict(temperature=0.5), [TemperatureLogitsWarper(0.5)]),
    (dict(temperature=1.0, top_k=3), [TopKLogitsWarper(3)]),
    (dict(temperature=1.0, top_p=0.8), [TopPLogitsWarper(0.8)]),
    (dict(temperature=1.0, min_p=0.2), [MinPLogitsWarper(0.2)]),
    (dict(temperature=0.7, top_k=6, top_p=0.9), [TemperatureLogitsWarper(0.7), TopKLogitsWarper(6), TopPLogitsWarper(0.9)]),
], ids=["plain", "temperature", "top_k", "top_p", "min_p", "combined"])
def test_samples_follow_the_filtered_distribution(logits, fields, warpers):
    probs = expected_probs(logits, *warpers)
    counts = draw(logits, SamplingParams(**fields))
    assert set(counts.nonzero().flatten().tolist()) <= set(probs.nonzero().flatten().tolist())
    frequencies = counts.double() / DRAWS
    # 4000 draws: the standard error of a frequency is at most 0.008.
    assert torch.allclose(frequencies, probs.double(), atol=0.035)


def test_greedy_and_top_k_1_pick_the_argmax(logits):
    shuffled = logits[:, torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))]
    best = int(shuffled.argmax())
    assert sample(shuffled.clone(), [state(SamplingParams(temperature=0))], torch.Generator()) == [best]
    assert draw(shuffled, SamplingParams(temperature=1.5, top_k=1), count=200)[best] == 200


def test_repetition_penalty_matches_transformers(logits):
    prompt, output = [0, 4], [9, 9, 7]
    expected = RepetitionPenaltyLogitsProcessor(1.8)(torch.tensor([prompt + output]), logits.clone())
    penalized = logits.clone()
    sample(penalized, [state(SamplingParams(temperature=0, repetition_penalty=1.8), prompt, output)], torch.Generator())
    assert torch.allclose(penalized, expected)


def test_presence_and_frequency_penalties_follow_openai_rule(logits):
    prompt, output = [1], [0, 0, 2]
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25)
    penalized = logits.clone()
    token = sample(penalized, [state(params, prompt, output)], torch.Generator())
    counts = torch.bincount(torch.tensor(output), minlength=VOCAB).float()
    assert torch.allclose(penalized, logits - 0.25 * counts - 0.5 * (counts > 0).float())
    assert token == [1]  # token 0 lost 1.0, token 1 (prompt only) is not penalized


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, EOS], logits[0, 5], logits[0, 3] = 10.0, 9.0, 1.0
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5])
    assert sample(logits.clone(), [state(params, output=[3])], torch.Generator()) == [3]
    assert sample(logits.clone(), [state(params, output=[3, 3])], torch.Generator()) == [EOS]
    ignoring = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sample(logits.clone(), [state(ignoring, output=[3])], torch.Generator()) == [EOS]


def test_a_seeded_row_draws_the_same_whatever_shares_the_batch(logits):
    params = SamplingParams(temperature=1.0, seed=42)
    crowd = SamplingParams(temperature=1.0)

    def seeded_draws(batch_position: int, batch_size: int, default_seed: int) -> list[int]:
        seeded = state(params, seed=42)
        tokens = []
        default = torch.Generator().manual_seed(default_seed)
        for _ in range(20):
            states = [state(crowd) for _ in range(batch_size)]
            states[batch_position] = seeded
            tokens.append(sample(logits.repeat(batch_size, 1), states, default)[batch_position])
            seeded.token_ids.append(tokens[-1])
        return tokens

    alone = seeded_draws(0, 1, default_seed=0)
    assert seeded_draws(3, 5, default_seed=1) == alone
    assert seeded_draws(1, 2, default_seed=2) == alone
    assert len(set(alone)) > 1  # it really samples


@pytest.mark.parametrize("uniform, expected", [(0.0, 1), (0.5, 2), (1 - 2**-24, 2)])
def test_a_draw_never_lands_on_a_token_of_zero_probability(monkeypatch, uniform, expected):
    """The inverse-CDF draw at the ends of [0, 1): the zero-probability tokens before and after
    the possible ones are never chosen."""
    probs = torch.tensor([[0.0, 0.3, 0.7, 0.0, 0.0]])
    monkeypatch.setattr(torch, "rand", lambda *shape, dtype, **kwargs: torch.full(shape, uniform, dtype=dtype))
    assert sampler._draw(probs.double().cumsum(dim=-1), [None], torch.Generator()).tolist() == [expected]


def test_a_token_of_tiny_probability_beside_likely_ones_can_be_drawn(monkeypatch):
    """1e-9 next to 0.5 vanishes from a float32 running sum; the draw must still reach it."""
    probs = torch.tensor([[0.5, 1e-9, 0.5 - 1e-9]])
    monkeypatch.setattr(torch, "rand", lambda *shape, dtype, **kwargs: torch.full(shape, 0.5 + 2e-10, dtype=dtype))
    assert sampler._draw(probs.double().cumsum(dim=-1), [None], torch.Generator()).tolist() == [1]


def test_logit_bias_shifts_the_distribution_and_bans_or_forces_tokens(logits):
    forced = SamplingParams(temperature=0, logit_bias={7: 100.0})
    assert sample(logits.clone(), [state(forced)], torch.Generator()) == [7]
    banned = draw(logits, SamplingParams(temperature=1.0, logit_bias={0: -100.0, 1: -100.0}))
    assert banned[0] == 0 and banned[1] == 0
    shifted = draw(logits, SamplingParams(temperature=1.0, logit_bias={3: 1.0}))
    expected = (logits[0] + torch.nn.functional.one_hot(torch.tensor(3), VOCAB)).softmax(dim=-1)
    assert abs(shifted[3].item() / DRAWS - expected[3].item()) < 0.02


def test_a_row_with_no_distribution_is_named_and_nothing_is_drawn(logits):
    generator = torch.Generator().manual_seed(5)
    before = generator.get_state()
    nan = SamplingParams(temperature=1.0)
    nan.temperature = float("nan")  # past validation, as a request reaching the engine another way
    rows = logits.repeat(3, 1)
    with pytest.raises(sampler.InvalidRowsError) as error:
        sample(rows, [state(SamplingParams(temperature=0.5)), state(nan), state(SamplingParams(temperature=0))],
               generator)
    assert error.value.rows == [1]
    assert torch.equal(generator.get_state(), before)

"""Deterministic mode's sampling (`SamplingState.gumbel_seed`): a row's token depends only on its
logits, its seed and its position, never on the rows beside it or their order; its tokens
over many positions follow the row's distribution; speculative verification gives exactly the
tokens of plain decoding. Every draw is a hash of fixed seeds, so no test here can flake."""

from __future__ import annotations

import pytest
import torch

from chunkserve import SamplingParams
from chunkserve.worker.gumbel import gumbel_argmax, request_seed
from chunkserve.worker import sampler
from chunkserve.worker.sampler import SamplingState, gather_logprobs, sample, sample_runs

VOCAB = 12
EOS = 11
LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.5, 0.1, -0.3, -0.8, -1.5, -2.0, -3.0, -4.0])
SAMPLED = SamplingParams(temperature=0.8, top_k=8, top_p=0.95)
POSITIONS = 10_000  # the least likely token of the plain distribution is still expected 8 times
# chi-square critical values at p = 0.001, by degrees of freedom
CHI2_CRITICAL_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124,
                      9: 27.877, 10: 29.588, 11: 31.264}


def det_state(params: SamplingParams = SAMPLED, seed: int = 7, length: int = 5, prompt: int = 3) -> SamplingState:
    """A deterministic request of `length` tokens so far (its next token is at position `length`)."""
    tokens = [(3 * i + 1) % VOCAB for i in range(length)]
    return SamplingState(params, tokens, prompt, EOS, None, gumbel_seed=seed)


def noisy_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return LOGITS + torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def other_rows() -> list[SamplingState]:
    """Neighbours of every kind: greedy, generator-seeded, unseeded, deterministic with other seeds."""
    return [SamplingState(SamplingParams(temperature=0), [1, 2], 1, EOS, None),
            SamplingState(SamplingParams(temperature=1.0, seed=3), [4], 1, EOS, torch.Generator().manual_seed(3)),
            SamplingState(SamplingParams(temperature=1.2, min_p=0.05), [5, 6, 7], 2, EOS, None),
            det_state(SamplingParams(temperature=0.5, repetition_penalty=1.3), seed=99, length=9),
            det_state(seed=8, length=2)]


def test_a_rows_token_is_the_same_alone_and_in_any_batch_and_order():
    target = det_state()
    logits = noisy_logits(6)
    alone = sample(logits[:1].clone(), [target], torch.Generator())
    neighbours = other_rows()
    for order in ([0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0], [2, 0, 4, 1, 5, 3]):
        states = [target if i == 0 else neighbours[i - 1] for i in order]
        tokens = sample(logits[order].clone(), states, torch.Generator().manual_seed(len(order)))
        assert tokens[order.index(0)] == alone[0]


def test_the_token_depends_on_the_seed_and_position_only():
    logits = LOGITS.expand(1, VOCAB)
    by_position = [sample(logits.clone(), [det_state(length=n)], torch.Generator())[0] for n in range(1, 41)]
    again = [sample(logits.clone(), [det_state(length=n, prompt=1)], torch.Generator().manual_seed(5))[0]
             for n in range(1, 41)]
    assert by_position == again  # another prompt split, another default generator: the same tokens
    other_seed = [sample(logits.clone(), [det_state(seed=8, length=n)], torch.Generator())[0] for n in range(1, 41)]
    assert other_seed != by_position
    assert len(set(by_position)) > 3  # positions draw afresh


def test_the_hash_draw_is_fixed_by_its_inputs():
    """The stream must not change between versions or processes: a checkpoint of its values."""
    probs = torch.softmax(LOGITS.double(), dim=-1)
    assert [gumbel_argmax(probs, 2024, position) for position in range(12)] == [1, 0, 4, 1, 1, 1, 0, 1, 0, 0, 1, 1]
    assert request_seed(0, "cmpl-1") == request_seed(0, "cmpl-1") != request_seed(0, "cmpl-1-1")
    assert request_seed(0, "cmpl-1") == 2093101728049382747
    assert gumbel_argmax(probs, -1, 0) == gumbel_argmax(probs, 2**64 - 1, 0)  # seeds taken modulo 2**64


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SAMPLED])
def test_tokens_over_many_positions_follow_the_rows_distribution(params):
    """The sampler draws the hash's token from the row's filtered distribution, and over many
    positions those tokens are distributed as that distribution (chi-square, p = 0.001)."""
    state = det_state(params)
    probs = sampler._filtered_probs(LOGITS.expand(1, VOCAB).clone(), [params]).double()[0]
    assert [sample(LOGITS.expand(1, VOCAB).clone(), [det_state(params, length=n)], torch.Generator())[0]
            for n in range(1, 101)] == [gumbel_argmax(probs, state.gumbel_seed, n) for n in range(1, 101)]
    counts = torch.zeros(VOCAB, dtype=torch.float64)
    for position in range(POSITIONS):
        counts[gumbel_argmax(probs, state.gumbel_seed, position)] += 1
    support = probs > 0
    assert counts[~support].sum() == 0
    expected = probs[support] * POSITIONS
    assert expected.min() >= 5, "too few positions for a chi-square test"
    statistic = float(((counts[support] - expected) ** 2 / expected).sum())
    assert statistic < CHI2_CRITICAL_P001[int(support.sum()) - 1], counts.tolist()


@pytest.mark.parametrize("params", [SAMPLED, SamplingParams(temperature=1.0, repetition_penalty=1.5,
                                                             frequency_penalty=0.4),
                                    SamplingParams(temperature=0)])
def test_verification_gives_exactly_the_tokens_of_plain_decoding(params):
    logits = noisy_logits(5, seed=1)
    base = det_state(params, seed=11, length=6)
    plain: list[int] = []
    for row in range(5):  # one token at a time, each row seeing the tokens before it
        state = SamplingState(params, base.token_ids + plain, base.num_prompt_tokens, EOS, None, gumbel_seed=11)
        plain += sample(logits[row : row + 1].clone(), [state], torch.Generator())
    for wrong_at in (0, 2, 4):  # a wrong draft: the run stops there with plain decoding's token
        drafts = plain[:4]
        if wrong_at < 4:
            drafts = drafts[:wrong_at] + [(plain[wrong_at] + 1) % VOCAB] + drafts[wrong_at + 1:]
        runs = sample_runs(logits.clone(), [det_state(params, seed=11, length=6)], [drafts],
                           torch.Generator().manual_seed(wrong_at))
        assert runs == [plain[: wrong_at + 1]]


def test_a_rows_logprobs_are_the_same_alone_and_in_a_batch():
    """The runner takes logprobs from all its rows' log_softmax at once: torch computes each row
    alone, which deterministic mode relies on."""
    logits = torch.randn(40, 49_152, generator=torch.Generator().manual_seed(2)) * 3  # SmolLM2's vocabulary
    batched = gather_logprobs(logits.log_softmax(dim=-1), [1] * 40, [5] * 40)
    for row in (0, 17, 39):
        assert gather_logprobs(logits[row : row + 1].log_softmax(dim=-1), [1], [5]) == [batched[row]]

"""Speculative verification (`sample_runs`): greedy rows keep the drafts that are the argmax,
sampled rows use rejection sampling, whose tokens must be distributed exactly as the target's
own (checked with chi-square tests over many independent draws); penalties and min_tokens see
a row's earlier drafts; a bad row names its request and draws nothing."""

from __future__ import annotations

import pytest
import torch

from chunkserve import SamplingParams
from chunkserve.worker.sampler import InvalidRowsError, SamplingState, sample, sample_runs

VOCAB = 12
EOS = 11
LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.9, 0.5, 0.1, -0.3, -0.8, -1.5, -2.0, -3.0, -4.0])
DRAWS = 15_000  # (a rejected draft's residual draw costs ~0.3 ms: this keeps each test to a few seconds)
# chi-square critical values at p = 0.001, by degrees of freedom
CHI2_CRITICAL = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124,
                 9: 27.877, 10: 29.588, 11: 31.264}
GREEDY = SamplingParams(temperature=0)
SAMPLED = SamplingParams(temperature=0.8, top_k=6)


def state(params: SamplingParams, prompt=(0,), output=(), seed: int | None = None) -> SamplingState:
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingState(params, list(prompt) + list(output), len(prompt), EOS, generator)


def peaked(*argmaxes: int) -> torch.Tensor:
    """One row per token: that token's logit is the largest."""
    rows = torch.zeros(len(argmaxes), VOCAB)
    for row, token in enumerate(argmaxes):
        rows[row, token] = 5.0
    return rows


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The filtered distribution (temperature, then top-k), written out plainly."""
    scaled = logits.double() / params.temperature
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    keep[scaled.topk(params.top_k).indices] = True
    return scaled.masked_fill(~keep, float("-inf")).softmax(dim=-1)


def assert_follows(tokens: list[int], probs: torch.Tensor) -> None:
    """Chi-square goodness of fit at p = 0.001; tokens of probability 0 never appear."""
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    support = probs > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {counts}"
    expected = probs[support] * len(tokens)
    assert expected.min() >= 5, "too few draws for a chi-square test"
    statistic = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    assert statistic < CHI2_CRITICAL[df], f"chi2 {statistic:.1f} >= {CHI2_CRITICAL[df]} (df {df}): {counts.tolist()}"


# ----- greedy verification -------------------------------------------------------------------


def test_greedy_all_drafts_accepted_adds_the_bonus_argmax():
    runs = sample_runs(peaked(3, 4, 5, 6), [state(GREEDY)], [[3, 4, 5]], torch.Generator())
    assert runs == [[3, 4, 5, 6]]


@pytest.mark.parametrize("drafts, expected", [
    ([7, 4, 5], [3]),  # the first draft is wrong: the argmax of the first row
    ([3, 9, 5], [3, 4]),  # the second: the accepted prefix, then the argmax of that row
    ([3, 4, 1], [3, 4, 5]),
])
def test_greedy_first_mismatch_ends_the_run_with_that_row_argmax(drafts, expected):
    assert sample_runs(peaked(3, 4, 5, 6), [state(GREEDY)], [drafts], torch.Generator()) == [expected]


def test_rows_stay_with_their_requests_whatever_each_accepts():
    states = [state(GREEDY) for _ in range(4)]
    drafts = [[1, 9], [], [3, 4, 5], [6]]  # rejected at its second, none, all accepted, all accepted
    logits = peaked(1, 2, 8,  # request 0: 1 accepted, 2 != 9, (8: the bonus row, unused)
                    7,  # request 1: its own token
                    3, 4, 5, 10,  # request 2: every draft, then the bonus
                    6, 0)  # request 3
    assert sample_runs(logits, states, drafts, torch.Generator()) == [[1, 2], [7], [3, 4, 5, 10], [6, 0]]


def test_without_drafts_it_is_sample():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    params = [GREEDY, SAMPLED, SamplingParams(temperature=1.3), GREEDY, SAMPLED, SamplingParams(top_p=0.7)]
    seeds = [None, 5, None, 1, None, 9]
    runs = sample_runs(logits.clone(), [state(p, seed=s) for p, s in zip(params, seeds)], [[] for _ in params],
                       torch.Generator().manual_seed(3))
    tokens = sample(logits.clone(), [state(p, seed=s) for p, s in zip(params, seeds)], torch.Generator().manual_seed(3))
    assert runs == [[t] for t in tokens]


def test_repetition_penalty_sees_earlier_drafts():
    """Row 1 prefers 5 (3.0) to 6 (2.0) unless the draft 5 before it counts as a token of the
    request: then the penalty halves it to 1.5 and 6 wins, so the draft 6 is accepted."""
    logits = torch.zeros(3, VOCAB)
    logits[0, 5] = 3.0
    logits[1, 5], logits[1, 6] = 3.0, 2.0
    logits[2, 7] = 3.0
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample_runs(logits, [state(params)], [[5, 6]], torch.Generator()) == [[5, 6, 7]]
    plain = logits.clone()
    plain[1] = 0.0
    plain[1, 5], plain[1, 6] = 3.0, 2.0
    # the same row without the draft before it: 5 is not penalized (the prompt is [0])
    assert sample_runs(plain[1:2].clone(), [state(params)], [[]], torch.Generator()) == [[5]]


def test_min_tokens_counts_earlier_drafts_as_output():
    """EOS leads every row; min_tokens=2 masks it while fewer than 2 tokens are out, and the
    third row comes after two drafts: EOS is allowed there."""
    logits = torch.zeros(3, VOCAB)
    logits[:, EOS] = 9.0
    logits[0, 3] = logits[1, 4] = 2.0
    params = SamplingParams(temperature=0, min_tokens=2)
    assert sample_runs(logits.clone(), [state(params)], [[3, 4]], torch.Generator()) == [[3, 4, EOS]]
    # one token already out: only the first row is masked, so the second draft is rejected for EOS
    assert sample_runs(logits.clone(), [state(params, output=[8])], [[3, 4]], torch.Generator()) == [[3, EOS]]


def test_an_invalid_row_names_its_request_and_draws_nothing():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1))
    logits[4, 2] = float("nan")  # request 1's bonus row (rows 2, 3, 4)
    logits[5, :] = float("nan")  # request 2's only row
    states = [state(SAMPLED, seed=1), state(SAMPLED, seed=2), state(GREEDY)]
    default = torch.Generator().manual_seed(4)
    before = [s.generator.get_state() for s in states[:2]] + [default.get_state()]
    with pytest.raises(InvalidRowsError) as error:
        sample_runs(logits, states, [[0], [0, 1], []], default)
    assert error.value.rows == [1, 2]  # states, not rows
    after = [s.generator.get_state() for s in states[:2]] + [default.get_state()]
    assert all(torch.equal(b, a) for b, a in zip(before, after)), "a generator advanced"


def test_an_invalid_greedy_draft_row_names_its_request():
    logits = peaked(1, 2, 3, 4)
    logits[2, 0] = float("nan")  # request 1's first row (request 0 owns rows 0 and 1)
    with pytest.raises(InvalidRowsError) as error:
        sample_runs(logits, [state(GREEDY), state(GREEDY)], [[1], [3]], torch.Generator())
    assert error.value.rows == [1]


# ----- rejection sampling -----------------------------------------------------------------------


def first_tokens(draft: int, draws: int) -> list[int]:
    runs = sample_runs(LOGITS.repeat(2 * draws, 1), [state(SAMPLED) for _ in range(draws)],
                       [[draft] for _ in range(draws)], torch.Generator().manual_seed(draft))
    return [run[0] for run in runs]


@pytest.mark.parametrize("draft, draws", [(5, DRAWS), (9, 3000)], ids=["unlikely draft", "draft outside top_k"])
def test_the_first_token_follows_the_target_distribution(draft, draws):
    """(A likely draft: the next test.) Token 5 has target probability ~0.04, 9 none (top_k)."""
    probs = target_probs(LOGITS, SAMPLED)
    tokens = first_tokens(draft, draws)
    assert_follows(tokens, probs)
    if probs[draft] > 0:  # it is accepted with its own probability
        assert abs(tokens.count(draft) / draws - float(probs[draft])) < 4 * (0.25 / draws) ** 0.5


def test_a_likely_draft_then_the_next_token_follow_the_target_rows():
    """The first token follows the first row's distribution (its draft 0 is the likeliest,
    accepted ~40% of the time); after it is accepted, the second token follows the second
    row's (whether the second draft is accepted or replaced by the residual draw)."""
    second_row = LOGITS.roll(4)  # another distribution: a token read from the wrong row would show
    third_row = LOGITS.flip(0)
    logits = torch.stack([LOGITS, second_row, third_row]).repeat(DRAWS, 1)
    drafts = [0, 1]  # 0 is the first row's likeliest; 1 is middling in the second row
    runs = sample_runs(logits, [state(SAMPLED) for _ in range(DRAWS)], [list(drafts) for _ in range(DRAWS)],
                       torch.Generator().manual_seed(1))
    assert all(1 <= len(run) <= 3 for run in runs)
    assert all(run[: len(run) - 1] == drafts[: len(run) - 1] for run in runs), "a run's prefix is not the drafts"
    first_row_probs = target_probs(LOGITS, SAMPLED)
    assert_follows([run[0] for run in runs], first_row_probs)
    accepted = [run for run in runs if run[0] == drafts[0]]
    assert abs(len(accepted) / DRAWS - float(first_row_probs[0])) < 4 * (0.25 / DRAWS) ** 0.5
    assert_follows([run[1] for run in accepted], target_probs(second_row, SAMPLED))


def test_the_bonus_token_follows_its_row():
    """Every draft accepted: the token after them is drawn from the last row."""
    certain = torch.full((VOCAB,), -10.0)
    certain[2] = 10.0  # the draft 2 is accepted with probability ~1
    draws = 6000
    logits = torch.stack([certain, LOGITS.roll(2)]).repeat(draws, 1)
    runs = sample_runs(logits, [state(SAMPLED) for _ in range(draws)], [[2] for _ in range(draws)],
                       torch.Generator().manual_seed(2))
    assert all(run[0] == 2 and len(run) == 2 for run in runs)
    assert_follows([run[1] for run in runs], target_probs(LOGITS.roll(2), SAMPLED))


def test_the_same_seed_gives_the_same_runs_whatever_shares_the_batch():
    count = 300
    logits = torch.stack([LOGITS, LOGITS.roll(3), LOGITS.roll(6)])
    drafts = [[0, 3] for _ in range(count)]

    def seeded_runs(with_others: bool, default_seed: int) -> list[list[int]]:
        states = [state(SAMPLED, seed=1000 + i) for i in range(count)]
        batch_states, batch_drafts = [], []
        for s, d in zip(states, drafts):
            if with_others:  # an unseeded request before each, drawing from the default generator
                batch_states.append(state(SAMPLED))
                batch_drafts.append([1])
            batch_states.append(s)
            batch_drafts.append(d)
        rows = torch.cat([logits if len(d) == 2 else logits[:2] for d in batch_drafts])
        runs = sample_runs(rows, batch_states, batch_drafts, torch.Generator().manual_seed(default_seed))
        return runs[1::2] if with_others else runs

    alone = seeded_runs(False, 0)
    assert seeded_runs(False, 0) == alone
    assert seeded_runs(True, 99) == alone
    assert len({tuple(run) for run in alone}) > 5, "different seeds should give different runs"


def test_unseeded_runs_follow_the_default_generator():
    logits = LOGITS.repeat(2 * 50, 1)

    def runs(seed: int) -> list[list[int]]:
        return sample_runs(logits.clone(), [state(SAMPLED) for _ in range(50)], [[1] for _ in range(50)],
                           torch.Generator().manual_seed(seed))

    assert runs(3) == runs(3)
    assert runs(3) != runs(4)

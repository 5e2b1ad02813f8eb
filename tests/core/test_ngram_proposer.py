"""Prompt lookup (n-gram) drafts: the longest suffix (within [min_n, max_n]) that occurred
before proposes what followed its most recent earlier occurrence, at most k tokens and never
past max_model_len."""

from __future__ import annotations

import random

import pytest

from chunkserve.core.spec_decode.ngram import NgramProposer

LONG = 10_000  # a max_model_len that clips nothing


def reference(tokens: list[int], min_n: int, max_n: int, k: int, max_model_len: int) -> list[int]:
    """The rule, written plainly: longest n first, then the latest earlier start."""
    k = min(k, max_model_len - len(tokens))
    if k <= 0:
        return []
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_vllm_docstring_case():
    assert NgramProposer(2, 3, 4).propose([1, 2, 3, 4, 2, 3], LONG) == [4, 2, 3]


def test_the_longest_match_wins_over_a_more_recent_shorter_one():
    # [7, 8, 9] occurred at 0 (followed by 1, 1); only [8, 9] occurred later (followed by 2, 2)
    tokens = [7, 8, 9, 1, 1, 8, 9, 2, 2, 7, 8, 9]
    assert NgramProposer(2, 3, 2).propose(tokens, LONG) == [1, 1]
    assert NgramProposer(2, 2, 2).propose(tokens, LONG) == [2, 2]  # (the shorter one, when it is all there is)


def test_the_most_recent_earlier_occurrence_is_used():
    tokens = [1, 2, 5, 1, 2, 6, 1, 2]
    assert NgramProposer(2, 2, 3).propose(tokens, LONG) == [6, 1, 2]
    assert NgramProposer(1, 1, 1).propose(tokens, LONG) == [6]


def test_no_match_proposes_nothing():
    assert NgramProposer(1, 3, 4).propose([1, 2, 3, 4, 5], LONG) == []
    # the 2-gram [3, 4] occurred, but min_n 3 asks for more
    assert NgramProposer(3, 4, 4).propose([3, 4, 9, 1, 3, 4], LONG) == []


@pytest.mark.parametrize("tokens", [[], [3], [3, 3]])
def test_too_few_tokens_propose_nothing(tokens):
    assert NgramProposer(2, 3, 4).propose(tokens, LONG) == []


def test_one_token_more_than_min_n_is_enough():
    assert NgramProposer(2, 3, 4).propose([3, 3, 3], LONG) == [3]


@pytest.mark.parametrize("room, expected", [(5, [3, 1, 2]), (2, [3, 1]), (1, [3]), (0, []), (-1, [])])
def test_k_is_clipped_at_max_model_len(room, expected):
    tokens = [1, 2, 3, 1, 2, 3, 1, 2]
    assert NgramProposer(1, 3, 4).propose(tokens, len(tokens) + room) == expected


def test_drafts_run_into_the_suffix_itself():
    # the latest earlier [5, 6] starts 2 before the suffix: what follows it is the suffix itself
    assert NgramProposer(2, 2, 4).propose([5, 6, 5, 6, 5, 6], LONG) == [5, 6]
    assert NgramProposer(1, 1, 4).propose([5, 6, 5, 6, 5, 6], LONG) == [5, 6]
    # a run of one token: the latest earlier [4, 4, 4] is one back, followed by the last token alone
    assert NgramProposer(1, 3, 4).propose([4, 4, 4, 4, 4], LONG) == [4]
    # a longer period proposes up to the end of the tokens, no further
    assert NgramProposer(3, 3, 8).propose([1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3], LONG) == [4, 1, 2, 3]


def test_random_sequences_follow_the_rule():
    rng = random.Random(0)
    for _ in range(400):
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        k = rng.randint(1, 6)
        tokens = [rng.randint(1, 3) for _ in range(rng.randint(0, 25))]
        max_model_len = len(tokens) + rng.randint(-1, 7)
        got = NgramProposer(min_n, max_n, k).propose(tokens, max_model_len)
        assert got == reference(tokens, min_n, max_n, k, max_model_len), (tokens, min_n, max_n, k, max_model_len)
        assert len(got) <= min(k, max(max_model_len - len(tokens), 0))


def test_bad_bounds_are_refused():
    with pytest.raises(AssertionError):
        NgramProposer(3, 2, 4)
    with pytest.raises(AssertionError):
        NgramProposer(0, 2, 4)
    with pytest.raises(AssertionError):
        NgramProposer(1, 2, 0)

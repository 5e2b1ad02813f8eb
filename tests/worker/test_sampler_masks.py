"""allowed_token_ids and bad_words in the sampler: a banned token is never drawn, greedy or
sampled; bad words follow vLLM's rule (a word's last token is banned once the output ends with
the tokens before it; the prompt does not count; a speculative draft counts for the rows after
it); a request whose masks leave no token fails alone, before anything is drawn."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from chunkserve import SamplingParams
from chunkserve.worker.sampler import InvalidRowsError, SamplingState, sample, sample_runs

VOCAB = 12
EOS = 11
LOGITS = torch.tensor([[2.0, 1.5, 1.2, 0.9, 0.5, 0.1, -0.3, -0.8, -1.5, -2.0, -3.0, -4.0]])


def state(params: SamplingParams, prompt=(0,), output=()) -> SamplingState:
    return SamplingState(params, list(prompt) + list(output), len(prompt), EOS, None)


def banning(*words: list[int], **fields) -> SamplingParams:
    """Params with bad words already tokenized (as the input processor leaves them)."""
    return SamplingParams(bad_words=[f"word{i}" for i in range(len(words))], _bad_words_token_ids=list(words),
                          **fields)


def greedy_token(params: SamplingParams, prompt=(0,), output=()) -> int:
    return sample(LOGITS.clone(), [state(params, prompt, output)], torch.Generator().manual_seed(0))[0]


def test_allowed_token_ids_restrict_greedy_and_sampled_tokens():
    allowed = [3, 7, 9]
    assert greedy_token(SamplingParams(temperature=0, allowed_token_ids=allowed)) == 3
    params = SamplingParams(temperature=1.0, allowed_token_ids=allowed)
    tokens = sample(LOGITS.repeat(3000, 1), [state(params) for _ in range(3000)], torch.Generator().manual_seed(1))
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB).double()
    assert set(torch.tensor(tokens).unique().tolist()) == set(allowed)
    expected = LOGITS[0, allowed].softmax(dim=-1)  # the distribution renormalised over the allowed tokens
    torch.testing.assert_close(counts[allowed] / 3000, expected.double(), atol=0.03, rtol=0)


def test_a_one_token_bad_word_is_always_banned():
    assert greedy_token(SamplingParams(temperature=0)) == 0
    assert greedy_token(banning([0], temperature=0)) == 1
    params = banning([0], [2], temperature=1.0)
    tokens = sample(LOGITS.repeat(2000, 1), [state(params) for _ in range(2000)], torch.Generator().manual_seed(2))
    assert not {0, 2} & set(tokens)


@pytest.mark.parametrize("prompt, output, banned", [
    ((0,), (), False),  # nothing generated yet
    ((0,), (4,), True),  # the output ends with the word's first token
    ((0,), (6, 4), True),
    ((0, 4), (), False),  # the prompt does not count
    ((0,), (4, 1), False),
])
def test_a_multi_token_bad_word_bans_its_last_token_after_the_tokens_before_it(prompt, output, banned):
    params = banning([4, 0], temperature=0)  # 0 is the greedy token
    assert greedy_token(params, prompt, output) == (1 if banned else 0)


def test_a_draft_counts_as_generated_for_the_rows_after_it():
    """Row 0 accepts draft 4; row 1 would pick 5, the end of bad word [4, 5], so it picks its next best."""
    logits = torch.zeros(2, VOCAB)
    logits[0, 4], logits[1, 5], logits[1, 6] = 5.0, 5.0, 4.0
    runs = sample_runs(logits, [state(banning([4, 5], temperature=0))], [[4]], torch.Generator().manual_seed(0))
    assert runs == [[4, 6]]


def test_masks_that_leave_no_token_fail_only_that_request_before_any_draw():
    healthy = SamplingParams(temperature=1.0)
    empty = SamplingParams(temperature=0, allowed_token_ids=[EOS], min_tokens=2)  # min_tokens masks EOS too
    generator = torch.Generator().manual_seed(3)
    before = generator.get_state()
    with pytest.raises(InvalidRowsError) as error:
        sample(LOGITS.repeat(3, 1), [state(healthy), state(empty), state(healthy)], generator)
    assert error.value.rows == [1]
    assert torch.equal(generator.get_state(), before)


def bitmask(*rows: list[int]) -> np.ndarray:
    """A grammar bitmask (llguidance's layout: bit t of int32 word t // 32) allowing each row's tokens."""
    packed = np.zeros((len(rows), 1), dtype=np.int32)
    for row, tokens in enumerate(rows):
        packed[row, 0] = np.array(sum(1 << t for t in tokens), dtype=np.int64).astype(np.int32)
    return packed


def test_a_grammar_bitmask_restricts_its_rows_only():
    params = SamplingParams(temperature=0)
    logits = LOGITS.repeat(2, 1)
    tokens = sample_runs(logits, [state(params), state(params)], [[], []], torch.Generator(),
                         [bitmask([4, 9]), None])
    assert tokens == [[4], [0]]  # the best allowed token; the row without a grammar is untouched
    params = SamplingParams(temperature=1.0)
    many = sample_runs(LOGITS.repeat(2000, 1), [state(params) for _ in range(2000)], [[]] * 2000,
                       torch.Generator().manual_seed(3), [bitmask([2, 5, 8])] * 2000)
    assert {run[0] for run in many} == {2, 5, 8}


def test_a_grammar_bitmask_has_a_row_per_draft_position():
    params = SamplingParams(temperature=0)
    # the draft 3 is allowed at row 0 (where the target prefers 3 among {3, 6}); at row 1 only 7 is allowed
    runs = sample_runs(LOGITS.repeat(2, 1), [state(params)], [[3]], torch.Generator(), [bitmask([3, 6], [7])])
    assert runs == [[3, 7]]


def test_a_grammar_that_allows_nothing_fails_its_request_alone():
    params = SamplingParams(temperature=0)
    with pytest.raises(InvalidRowsError) as failed:
        sample_runs(LOGITS.repeat(2, 1), [state(params), state(params)], [[], []], torch.Generator(),
                    [None, bitmask([])])
    assert failed.value.rows == [1]

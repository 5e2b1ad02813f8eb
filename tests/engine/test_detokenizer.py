"""Streaming text: deltas concatenate to the full decode, never split a character, and
hold back what might be the start of a stop string."""

from __future__ import annotations

import random

import pytest

from chunkserve import SamplingParams
from chunkserve.engine.detokenizer import IncrementalDetokenizer

MULTILINGUAL = "Café crème, naïve — 東京タワー 🚀🌍 emoji 👩‍👩‍👧 and Ωμέγα. Привет!  tabs\tand\nnewlines"


def stream(tokenizer, token_ids: list[int], params: SamplingParams, group: int = 1) -> tuple[list[str], str | None]:
    detokenizer = IncrementalDetokenizer(tokenizer, params)
    deltas, stopped = [], None
    for start in range(0, len(token_ids), group):
        stopped = detokenizer.add_tokens(token_ids[start : start + group])
        deltas.append(detokenizer.delta(finished=stopped is not None))
        if stopped:
            break
    else:
        deltas.append(detokenizer.delta(finished=True))
    assert "".join(deltas) == detokenizer.emitted_text
    return deltas, stopped


@pytest.mark.parametrize("group", [1, 3])
def test_deltas_concatenate_to_the_full_decode(default_tokenizer, group):
    ids = default_tokenizer.encode(MULTILINGUAL)
    deltas, _ = stream(default_tokenizer, ids, SamplingParams(), group)
    assert "".join(deltas) == default_tokenizer.decode(ids) == MULTILINGUAL
    assert all("\ufffd" not in delta for delta in deltas)


def test_random_token_ids_decode_the_same_incrementally(default_tokenizer):
    rng = random.Random(0)
    vocab = len(default_tokenizer)
    for _ in range(20):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        deltas, _ = stream(default_tokenizer, ids, SamplingParams())
        assert "".join(deltas) == default_tokenizer.decode(ids, skip_special_tokens=True)


def test_byte_tokens_of_one_character_are_held_until_it_completes(default_tokenizer):
    rocket = "🚀"
    byte_tokens = default_tokenizer.encode(rocket)
    assert len(byte_tokens) == 3  # byte-level BPE: the 4 UTF-8 bytes come in 3 tokens
    deltas, _ = stream(default_tokenizer, byte_tokens, SamplingParams())
    assert deltas[:3] == ["", "", rocket]


def test_stop_string_is_cut_and_never_streamed(default_tokenizer):
    text = "The answer is clear. STOP HERE and nothing after it."
    ids = default_tokenizer.encode(text)
    deltas, stopped = stream(default_tokenizer, ids, SamplingParams(stop=["never", "STOP HERE"]))
    assert stopped == "STOP HERE"
    assert "".join(deltas) == "The answer is clear. "
    assert all("S" not in delta for delta in deltas)


def test_held_back_text_is_released_when_no_stop_matches(default_tokenizer):
    text = "A partial STOP THERE is not a stop."
    ids = default_tokenizer.encode(text)
    deltas, stopped = stream(default_tokenizer, ids, SamplingParams(stop=["STOP HERE"]))
    assert stopped is None and "".join(deltas) == text

"""ShareGPT files sampled as vLLM's benchmarks sample them (chunkserve/bench/datasets.py)."""

from __future__ import annotations

import json
import random

import pytest

from chunkserve.bench.datasets import DatasetError, is_valid_sequence, load_sharegpt, sample_sharegpt


def conversation(human: str, gpt: str | None = None) -> dict:
    turns = [{"from": "human", "value": human}] + ([{"from": "gpt", "value": gpt}] if gpt is not None else [])
    return {"id": human, "conversations": turns}


def words(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def tokenize(text: str) -> list[int]:
    """One token per word: lengths the test can read off its own data."""
    return [len(word) for word in text.split()]


def write(tmp_path, data) -> str:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    return str(path)


def test_pairs_come_in_vllms_shuffled_order_and_one_turn_chats_are_dropped(tmp_path):
    data = [conversation(words(5, f"p{i}"), words(5)) for i in range(20)] + [conversation("alone")]
    pairs = load_sharegpt(write(tmp_path, data), seed=7)
    expected = [entry for entry in data if len(entry["conversations"]) >= 2]
    random.seed(7)  # what vLLM's ShareGPTDataset.load_data does
    random.shuffle(expected)
    assert pairs == [(e["conversations"][0]["value"], e["conversations"][1]["value"]) for e in expected]


def test_output_length_is_the_replys_unless_fixed_and_vllms_filters_apply():
    pairs = [(words(8), words(6)),      # kept: 8 in, 6 out
             (words(3), words(6)),      # prompt under 4 tokens
             (words(8), words(2)),      # reply under 4 tokens: kept only when the output length is fixed
             (words(1025), words(6)),   # prompt over 1024
             (words(1000), words(1049))]  # total over 2048
    kept = sample_sharegpt(pairs, tokenize, num_prompts=5, output_len=None, seed=0)
    assert [(len(r.prompt_token_ids), r.output_len) for r in kept[:1]] == [(8, 6)]
    assert all(r.prompt == words(8) and r.output_len == 6 for r in kept)  # the one pair that passes, drawn again
    fixed = sample_sharegpt(pairs, tokenize, num_prompts=2, output_len=3, seed=0)
    assert [(len(r.prompt_token_ids), r.output_len) for r in fixed] == [(8, 3), (8, 3)]
    assert is_valid_sequence(4, 4, fixed_output_len=False) and not is_valid_sequence(4, 3, fixed_output_len=False)


def test_sampling_stops_at_num_prompts_without_tokenizing_the_rest():
    seen = []

    def counting(text: str) -> list[int]:
        seen.append(text)
        return tokenize(text)

    pairs = [(words(5, f"p{i}"), words(5)) for i in range(100)]
    assert [r.prompt for r in sample_sharegpt(pairs, counting, 3, None, 0)] == [p for p, _ in pairs[:3]]
    assert len(seen) == 6


@pytest.mark.parametrize("content, message", [
    ("{not json", "sharegpt.json"),
    (json.dumps({"conversations": []}), "a JSON list of conversations"),
    (json.dumps([{"conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]}]), "without a 'value'"),
])
def test_a_broken_file_is_named(tmp_path, content, message):
    path = tmp_path / "sharegpt.json"
    path.write_text(content)
    with pytest.raises(DatasetError, match=message):
        load_sharegpt(str(path), seed=0)


def test_nothing_passing_the_filters_is_an_error():
    with pytest.raises(DatasetError, match="length filters"):
        sample_sharegpt([("a b", "c d")], tokenize, 4, None, 0)

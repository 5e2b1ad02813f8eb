"""Speculative decoding through the real server: the tiny model (tests/tiny_model.py) drafting
for itself (`--speculative-config` method draft_model, policy always) gives the engine's greedy
text without speculation, and /metrics counts every draft accepted: acceptance rate 1.0 and mean
acceptance length k + 1 (vLLM's spec_decode_* counters). A model's own greedy drafts are all
accepted whatever its weights, so the random tiny model checks this as well as a real one."""

from __future__ import annotations

import json

import pytest

from chunkserve import SamplingParams
from tests.engine.tiny_llm_support import TINY, build_llm
from tests.server_process import start_server, stop_server
from tests.tiny_model import TINY_SERVER_ENV, tiny_server_flags

K = 3
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Repeat exactly: The quick brown fox jumps over the lazy dog."]
# The prompt's step samples one token and proposes k drafts; every later step verifies k drafts,
# all accepted, and makes k + 1 tokens; the drafts proposed are trimmed to what max_tokens leaves
# room for. With 2 + 6 (k + 1) tokens: six full runs, then a step without drafts for the last token
# (a draft-model proposal needs room for its bonus token too), so no run is a short one.
RUNS_PER_REQUEST = 6
MAX_TOKENS = 2 + RUNS_PER_REQUEST * (K + 1)
DRAFTS = "chunkserve:spec_decode_num_drafts_total{}"
DRAFT_TOKENS = "chunkserve:spec_decode_num_draft_tokens_total{}"
ACCEPTED = "chunkserve:spec_decode_num_accepted_tokens_total{}"


def per_pos(position: int) -> str:
    return f"chunkserve:spec_decode_num_accepted_tokens_per_pos_total{{position={position}}}"


@pytest.fixture(scope="module")
def self_draft_server(tmp_path_factory, tiny_gguf):
    config = {"method": "draft_model", "model": tiny_gguf, "num_speculative_tokens": K, "policy": "always"}
    started = start_server(tmp_path_factory, *tiny_server_flags(tiny_gguf), "--max-num-batched-tokens", "256",
                           "--max-num-seqs", "16", "--speculative-config", json.dumps(config),
                           name="self-draft-server", env=TINY_SERVER_ENV)
    yield started
    stop_server(started)


@pytest.fixture(scope="module")
def tiny_llm(tiny_gguf):
    """The same model without speculation: the text the server must give."""
    return build_llm(TINY, tiny_gguf, max_num_batched_tokens=256, max_num_seqs=16)


def test_self_draft_accepts_every_draft(self_draft_server, tiny_llm):
    server = self_draft_server
    prompts = [tiny_llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = tiny_llm.generate(prompts, params, use_tqdm=False)
    before = server.metrics()
    assert before[DRAFTS] == before[DRAFT_TOKENS] == before[ACCEPTED] == 0
    with server.client() as http:
        response = http.post("/v1/completions", json={
            "prompt": prompts, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "skip_special_tokens": False})
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    tokenizer = tiny_llm.get_tokenizer()
    for choice, reference in zip(choices, expected):
        assert choice["finish_reason"] == "length"
        assert choice["text"] == tokenizer.decode(reference.outputs[0].token_ids, skip_special_tokens=False)
    assert response.json()["usage"]["completion_tokens"] == len(prompts) * MAX_TOKENS

    num_runs = len(prompts) * RUNS_PER_REQUEST
    metrics = server.wait_until(lambda m: m[DRAFTS] >= num_runs)
    drafts, draft_tokens, accepted = metrics[DRAFTS], metrics[DRAFT_TOKENS], metrics[ACCEPTED]
    assert drafts == num_runs and draft_tokens == K * num_runs
    assert accepted / draft_tokens == 1.0, "the target rejected its own greedy drafts"
    # (so vLLM's mean acceptance length, 1 + accepted / drafts, is K + 1 here)
    assert [metrics.get(per_pos(p)) for p in range(K)] == [num_runs] * K
    assert per_pos(K) not in metrics
    assert metrics["chunkserve:generation_tokens_total{}"] == len(prompts) * MAX_TOKENS
    report = server.check()
    assert report["ok"], report  # idle: every block free or cached, no request left

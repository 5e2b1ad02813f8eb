"""Beam search (chunkserve.engine.beam_search, vLLM's rules): the pure step and ranking on
hand-made records, then LLM.beam_search on a tiny random Llama against transformers' own
beam search (no EOS in reach: the two rules agree there), against a reference search over
transformers' logits with an EOS in reach, and width 1 against greedy generation."""

from __future__ import annotations

import pytest
import torch

from chunkserve import LLM, SamplingParams
from chunkserve.core.messages import TokenLogprobs
from chunkserve.engine import beam_search as beams
from chunkserve.engine.beam_search import BeamSearchSequence
from chunkserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from chunkserve.errors import InvalidRequestError
from chunkserve.sampling_params import BeamSearchParams
from tests.engine.support import save_tiny_llama

EOS = 0


def output(prompt_token_ids: list[int], record: TokenLogprobs) -> RequestOutput:
    """A beam's step request as the engine returns it."""
    return RequestOutput("r", None, prompt_token_ids, [CompletionOutput(0, "", [record.token_id], logprobs=[record])],
                         True, RequestMetrics(0.0))


def params(width: int, **fields) -> BeamSearchParams:
    return BeamSearchParams(beam_width=width, max_tokens=fields.pop("max_tokens", 8), **fields)


# ----- the pure rules ------------------------------------------------------------------------------


def test_an_eos_candidate_finishes_and_the_best_others_live_on():
    record = TokenLogprobs(5, -0.5, [(5, -0.5), (EOS, -0.7), (6, -1.0), (7, -2.0)], rank=1)
    live, finished = beams.next_beams([(BeamSearchSequence([9, 9]), output([9, 9], record))], params(2), EOS)
    assert [(b.tokens, b.cum_logprob) for b in live] == [([9, 9, 5], -0.5), ([9, 9, 6], -1.0)]
    assert [(b.tokens, b.finish_reason, b.stop_reason) for b in finished] == [([9, 9, EOS], "stop", EOS)]
    assert all(b.records == [record] for b in live + finished)
    live, finished = beams.next_beams([(BeamSearchSequence([9, 9]), output([9, 9], record))],
                                      params(2, ignore_eos=True, length_penalty=0.0), EOS)
    assert [b.tokens[-1] for b in live] == [5, EOS] and finished == []
    # vLLM's length leaves a final EOS out even then: over 2 tokens, EOS's -0.7 ranks below 6's -1.0 over 3
    live, _ = beams.next_beams([(BeamSearchSequence([9, 9]), output([9, 9], record))], params(2, ignore_eos=True),
                               EOS)
    assert [b.tokens[-1] for b in live] == [5, 6]


def test_a_sampled_token_outside_the_top_is_a_candidate_and_beams_of_one_prompt_compete():
    sampled = TokenLogprobs(8, -0.2, [(5, -0.1), (6, -0.3)], rank=40)  # a toy record: vLLM's dict would hold 8 too
    other = TokenLogprobs(5, -0.05, [(5, -0.05), (6, -4.0)], rank=1)
    pairs = [(BeamSearchSequence([1, 2], -3.0), output([1, 2], sampled)),
             (BeamSearchSequence([1, 3], -1.0), output([1, 3], other))]
    live, _ = beams.next_beams(pairs, params(3), EOS)
    assert [(b.tokens, round(b.cum_logprob, 6)) for b in live] == [([1, 3, 5], -1.05), ([1, 2, 5], -3.1),
                                                                     ([1, 2, 8], -3.2)]
    assert beams.candidates(sampled) == [(8, -0.2), (5, -0.1), (6, -0.3)]


def test_the_score_divides_by_the_whole_length_without_a_final_eos():
    beam = BeamSearchSequence([1, 2, 3, EOS], -6.0)
    assert beams.beam_score(beam, EOS, 1.0) == pytest.approx(-2.0)  # 3 tokens: the prompt counts, the EOS not
    assert beams.beam_score(beam, 99, 2.0) == pytest.approx(-6.0 / 16)
    assert beams.beam_score(beam, EOS, 0.0) == -6.0


def toy_run(table: dict[int, TokenLogprobs]):
    """A model whose next-token record depends on the last token only (the first prompt's last
    token for a text prompt, which this toy 'tokenizes' as [9])."""

    def run(batch):
        return [output(p if isinstance(p, list) else [9], table[(p if isinstance(p, list) else [9])[-1]])
                for p in batch]

    return run


@pytest.mark.parametrize("length_penalty, winner", [(0.0, [9, EOS]), (1.0, [9, 1, 3])])
def test_finished_and_live_beams_are_ranked_together_with_the_length_penalty(length_penalty, winner):
    # width 1: after "9" EOS is the best (finished, score -0.5 / 1), "1" lives on; after "1", "3" (cum -1.1 over
    # 3 tokens): with length_penalty 1 its score -0.37 beats the finished one, with 0 it does not
    table = {9: TokenLogprobs(EOS, -0.5, [(EOS, -0.5), (1, -1.0)], 1),
             1: TokenLogprobs(3, -0.1, [(3, -0.1), (4, -2.0)], 1)}
    search = beams.search(["text"], params(1, max_tokens=2, length_penalty=length_penalty), EOS, 100, 20)
    (found,) = beams.run_sync(search, toy_run(table))
    assert [b.tokens for b in found] == [winner]
    assert found[0].finish_reason == ("stop" if winner[-1] == EOS else "length")


def test_steps_stop_at_max_tokens_or_max_model_len_and_the_width_is_bounded_by_max_logprobs():
    table = {t: TokenLogprobs(t + 1, -1.0, [(t + 1, -1.0), (t + 50, -2.0)], 1) for t in range(1, 200)}
    (found,) = beams.run_sync(beams.search([[1, 2, 3]], params(1, max_tokens=10), EOS, 6, 20), toy_run(table))
    assert found[0].tokens == [1, 2, 3, 4, 5, 6]  # max_model_len 6
    (found,) = beams.run_sync(beams.search([[1, 2, 3]], params(1, max_tokens=2), EOS, 100, 20), toy_run(table))
    assert found[0].tokens == [1, 2, 3, 4, 5] and found[0].num_prompt_tokens == 3
    with pytest.raises(InvalidRequestError, match="n 11 makes beam search ask for 22 logprobs") as error:
        next(beams.search([[1]], params(11), EOS, 100, 20, width_name="n"))
    assert error.value.param == "n"


def test_the_servers_completion_leaves_eos_out_of_the_text_and_shows_the_taken_tokens_records(default_tokenizer):
    eos = default_tokenizer.eos_token_id
    first = TokenLogprobs(7, -0.5, [(7, -0.5), (8, -0.9), (9, -1.0)], 1)
    second = TokenLogprobs(8, -0.1, [(8, -0.1), (eos, -0.3)], 1)
    beam = BeamSearchSequence([1, 2, 8, eos], -1.2, finish_reason="stop", stop_reason=eos, records=[first, second])
    plain = beams.completion(beam, params(2), default_tokenizer, 1)
    assert plain.token_ids == [8] and plain.text == default_tokenizer.decode([8])
    assert plain.logprobs == [TokenLogprobs(8, -0.9, [(7, -0.5)], 2)] and plain.cumulative_logprob == -1.2
    kept = beams.completion(beam, params(2, include_stop_str_in_output=True), default_tokenizer, None)
    assert kept.token_ids == [8, eos] and kept.text == plain.text and kept.logprobs is None
    assert (kept.finish_reason, kept.stop_reason) == ("stop", eos)


# ----- the search on a model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_tokenizer):
    """Our engine (blocks of 4 tokens: every step reads the beam's prefix from the cache) and transformers' model."""
    folder = tmp_path_factory.mktemp("tiny-beam")
    model = save_tiny_llama(folder, default_tokenizer)
    return LLM(str(folder), dtype="float32", kv_cache_memory_gb=0.05, block_size=4), model


PROMPT = [19556, 665, 1000, 2000, 3000]


def test_width_one_is_greedy(tiny):
    llm, _ = tiny
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0),
                          use_tqdm=False)[0].outputs[0]
    (found,) = llm.beam_search([PROMPT], BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True))
    (beam,) = found.sequences
    assert beam.tokens == PROMPT + greedy.token_ids
    # each step re-reads the cached prefix and computes the rest as a prompt chunk: fp32 noise, not 1e-6
    assert beam.cum_logprob == pytest.approx(greedy.cumulative_logprob, abs=1e-5)


@pytest.mark.parametrize("length_penalty", [0.0, 1.0, 2.0])
def test_width_three_equals_transformers_beam_search(tiny, length_penalty):
    """No EOS comes near (random weights, 49K tokens): transformers' rule and vLLM's keep the same
    beams. transformers' sequences_scores divide by the output's length ** length_penalty."""
    llm, model = tiny
    steps = 6
    (found,) = llm.beam_search([{"prompt_token_ids": PROMPT}],
                               BeamSearchParams(beam_width=3, max_tokens=steps, length_penalty=length_penalty))
    with torch.inference_mode():
        expected = model.generate(torch.tensor([PROMPT]), num_beams=3, num_return_sequences=3, do_sample=False,
                                  max_new_tokens=steps, length_penalty=length_penalty, early_stopping=False,
                                  output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    assert [b.tokens for b in found.sequences] == expected.sequences.tolist()
    assert [b.cum_logprob for b in found.sequences] == pytest.approx(
        (expected.sequences_scores * steps ** length_penalty).tolist(), abs=1e-4)
    assert all(b.finish_reason == "length" for b in found.sequences)


def reference_search(model, prompt: list[int], width: int, steps: int, eos: int,
                     length_penalty: float) -> list[tuple[list[int], float]]:
    """vLLM's rule, written out over transformers' logits (greedy steps: the candidates are each
    beam's top 2 * width)."""

    def score(beam):
        tokens, cum = beam
        return cum / (len(tokens) - (tokens[-1] == eos)) ** length_penalty

    live, finished = [(prompt, 0.0)], []
    for _ in range(steps):
        candidates = []
        for tokens, cum in live:
            with torch.inference_mode():
                row = model(torch.tensor([tokens])).logits[0, -1].log_softmax(-1)
            values, ids = row.topk(2 * width)
            for token, value in zip(ids.tolist(), values.tolist()):
                (finished if token == eos else candidates).append((tokens + [token], cum + value))
        live = sorted(candidates, key=score, reverse=True)[:width]
    return sorted(finished + live, key=score, reverse=True)[:width]


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_beams_that_reach_eos_as_a_reference_search_over_transformers_logits(tiny, length_penalty):
    """EOS made reachable: the prompt's second most likely next token is taken as EOS."""
    llm, model = tiny
    with torch.inference_mode():
        eos = model(torch.tensor([PROMPT])).logits[0, -1].topk(2).indices[1].item()
    processor = llm.engine.input_processor
    kept, processor.eos_token_id = processor.eos_token_id, eos
    try:
        (found,) = llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=4,
                                                               length_penalty=length_penalty))
    finally:
        processor.eos_token_id = kept
    expected = reference_search(model, PROMPT, 2, 4, eos, length_penalty)
    assert [b.tokens for b in found.sequences] == [tokens for tokens, _ in expected]
    assert [b.cum_logprob for b in found.sequences] == pytest.approx([cum for _, cum in expected], abs=1e-4)
    if length_penalty == 0.0:  # one token at about -7 beats four
        assert found.sequences[0].tokens == PROMPT + [eos] and found.sequences[0].finish_reason == "stop"
    tokenizer = llm.get_tokenizer()
    for beam in found.sequences:  # vLLM's offline shape: the prompt's tokens and text included
        assert beam.text == tokenizer.decode(beam.tokens)
        assert len(beam.logprobs) == len(beam.tokens) - len(PROMPT)
        for token, entries in zip(beam.tokens[len(PROMPT):], beam.logprobs):
            assert token in entries and len(entries) == 4  # the step's top 2 * width (its sampled token among them)
            assert sorted(e.rank for e in entries.values()) == [1, 2, 3, 4]

"""Beam search as vLLM runs it, on top of the engine. At each step every live beam is a
one-token request (the prompt and the beam's tokens so far: the prefix cache holds all but
their last partial block, so the re-prefill is short) asking for 2 * beam_width logprobs. Each
beam's candidates are those top tokens and its sampled one; a candidate that is EOS is set
aside as finished (unless ignore_eos), and the beam_width best others live on, ranked by
vLLM's length-penalised score. After max_tokens steps, or when no beam lives, finished and
live beams are ranked together and the best beam_width are the answer.

The search is a generator (`search`) that yields each step's prompts and takes back their
outputs, so the synchronous driver (`LLM.beam_search`) and the asynchronous one
(`beam_search_async`, the server's `use_beam_search`) share every rule.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

from chunkserve.core.messages import TokenLogprobs
from chunkserve.engine.async_llm import AsyncLLM, RequestStream
from chunkserve.engine.outputs import CompletionOutput, LogprobDict, RequestOutput
from chunkserve.errors import InvalidRequestError
from chunkserve.sampling_params import BeamSearchParams

Prompt = str | list[int]


@dataclass
class BeamSearchSequence:
    """One beam (vLLM's shape). `tokens` holds the prompt too, as in vLLM; `records` the
    engine's record of each step that made it (the step's sampled token and its top
    2 * beam_width), which `logprobs` shows as vLLM's dicts once LLM.beam_search fills it."""

    tokens: list[int]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | str | None = None  # the EOS token id that ended it
    logprobs: list[LogprobDict] = field(default_factory=list)
    records: list[TokenLogprobs] = field(default_factory=list, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.tokens) - len(self.records)


Search = Generator[list[Prompt], list[RequestOutput], list[list[BeamSearchSequence]]]


@dataclass
class BeamSearchOutput:
    """vLLM's: the best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_token_id: int | None, length_penalty: float) -> float:
    """vLLM's sort key (after transformers'): cumulative logprob / length ** length_penalty, the
    length counting the prompt's tokens and not a final EOS."""
    length = len(beam.tokens) - (beam.tokens[-1] == eos_token_id)
    return beam.cum_logprob / length ** length_penalty


def candidates(record: TokenLogprobs) -> list[tuple[int, float]]:
    """A step's (token, logprob) candidates: the sampled token, then the top ones (vLLM's dict order)."""
    return [(record.token_id, record.logprob), *((t, lp) for t, lp in record.top if t != record.token_id)]


def next_beams(beams: list[tuple[BeamSearchSequence, RequestOutput]], params: BeamSearchParams,
               eos_token_id: int | None) -> tuple[list[BeamSearchSequence], list[BeamSearchSequence]]:
    """One step of one prompt's search: each (beam, the output of its step request) -> the
    beams that live on (at most beam_width, best first) and those that ended with EOS. A beam
    whose request brought no record (aborted) has no children, as in vLLM."""
    live, finished = [], []
    for beam, output in beams:
        if not output.outputs[0].logprobs:
            continue
        record = output.outputs[0].logprobs[0]
        for token_id, logprob in candidates(record):
            child = BeamSearchSequence(output.prompt_token_ids + [token_id], beam.cum_logprob + logprob,
                                       records=beam.records + [record])
            if token_id == eos_token_id and not params.ignore_eos:
                child.finish_reason, child.stop_reason = "stop", token_id
                finished.append(child)
            else:
                live.append(child)
    live.sort(key=lambda b: beam_score(b, eos_token_id, params.length_penalty), reverse=True)
    return live[: params.beam_width], finished


def search(prompts: Sequence[Prompt], params: BeamSearchParams, eos_token_id: int | None, max_model_len: int,
           max_logprobs: int, width_name: str = "beam_width") -> Search:
    """The search over every prompt at once: yields each step's prompts (a live beam's tokens;
    at the first step the prompt as given, which the engine tokenizes and checks), takes back
    one output per prompt (the step's request, with its logprobs record), and returns each
    prompt's best beam_width beams, best first. A beam stops at max_model_len. Raises
    InvalidRequestError (naming `width_name`) if a step's 2 * width logprobs are above the
    engine's limit."""
    if 2 * params.beam_width > max_logprobs:
        raise InvalidRequestError(f"{width_name} {params.beam_width} makes beam search ask for {2 * params.beam_width} "
                                  f"logprobs per step, above the limit of {max_logprobs} (--max-logprobs)", width_name)
    live = [[BeamSearchSequence([])] for _ in prompts]  # no tokens yet: the first step sends the prompt itself
    finished: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    steps = [math.inf] * len(prompts)  # known once the first step told the prompt's length
    for step in itertools.count():
        active = [i for i, beams in enumerate(live) if beams and step < steps[i]]
        if not active:
            break
        outputs = iter((yield [beam.tokens or prompts[i] for i in active for beam in live[i]]))
        for i in active:
            pairs = [(beam, next(outputs)) for beam in live[i]]
            if step == 0:
                room = max_model_len - len(pairs[0][1].prompt_token_ids)
                steps[i] = room if params.max_tokens is None else min(params.max_tokens, room)
            live[i], done = next_beams(pairs, params, eos_token_id)
            finished[i] += done
    best = []
    for beams, done in zip(live, finished):
        for beam in beams:
            beam.finish_reason = "length"
        ranked = sorted(done + beams, key=lambda b: beam_score(b, eos_token_id, params.length_penalty), reverse=True)
        best.append(ranked[: params.beam_width])
    return best


def run_sync(search: Search, run: Callable[[list[Prompt]], list[RequestOutput]]) -> list[list[BeamSearchSequence]]:
    """Drive `search`, `run` computing each step's requests."""
    try:
        batch = next(search)
        while True:
            batch = search.send(run(batch))
    except StopIteration as done:
        return done.value


async def run_async(search: Search,
                    run: Callable[[list[Prompt]], Awaitable[list[RequestOutput]]]) -> list[list[BeamSearchSequence]]:
    """Drive `search`, awaiting `run` for each step's requests."""
    try:
        batch = next(search)
        while True:
            batch = search.send(await run(batch))
    except StopIteration as done:
        return done.value


async def beam_search_async(engine: AsyncLLM, request_id: str, prompts: Sequence[Prompt], params: BeamSearchParams,
                            priority: int = 0, cache_salt: str | None = None, width_name: str = "beam_width",
                            **add_options: Any) -> list[list[BeamSearchSequence]]:
    """Beam search through an AsyncLLM (the server's use_beam_search): each step's requests run
    together; if this is cancelled (the client left) or one fails, the step's others are
    aborted. `add_options`: AsyncLLM.add_request's, for the prompts as given (add_special_tokens)."""
    step_params = params.step_params()
    counter = itertools.count()

    async def run(batch: list[Prompt]) -> list[RequestOutput]:
        step = next(counter)
        added = await asyncio.gather(*(
            engine.add_request(f"{request_id}-beam-{step}-{i}", prompt, step_params, priority, cache_salt=cache_salt,
                               **add_options)
            for i, prompt in enumerate(batch)), return_exceptions=True)
        streams = [s for s in added if isinstance(s, RequestStream)]
        try:
            for error in added:
                if isinstance(error, BaseException):
                    raise error
            return [await _last(stream) for stream in streams]
        finally:
            for stream in streams:
                stream.abort()

    return await run_async(search(prompts, params, engine.input_processor.eos_token_id, engine.info.max_model_len,
                                  engine.input_processor.limits.max_logprobs, width_name), run)


async def _last(stream: RequestStream) -> RequestOutput:
    last = None
    async for output in stream:
        last = output
    return last


def completion(beam: BeamSearchSequence, params: BeamSearchParams, tokenizer: Any,
               num_logprobs: int | None) -> CompletionOutput:
    """A beam as the server answers it (vLLM's server; index 0, its place is the caller's): the
    output tokens, a final EOS among them only with include_stop_str_in_output and never in the
    text; with `num_logprobs`, each token's record (its logprob and rank, and the step's top
    num_logprobs)."""
    output = beam.tokens[beam.num_prompt_tokens:]
    ends_with_eos = beam.finish_reason == "stop"
    token_ids = output if params.include_stop_str_in_output or not ends_with_eos else output[:-1]
    records = None
    if num_logprobs is not None:
        records = [_record_of(token_id, record, num_logprobs) for token_id, record in zip(token_ids, beam.records)]
    return CompletionOutput(0, tokenizer.decode(output[:-1] if ends_with_eos else output), token_ids,
                            beam.finish_reason, beam.stop_reason, logprobs=records, cumulative_logprob=beam.cum_logprob)


def _record_of(token_id: int, record: TokenLogprobs, num_top: int) -> TokenLogprobs:
    """The step's record as seen from the token the beam took (one of its candidates)."""
    if token_id == record.token_id:
        return TokenLogprobs(token_id, record.logprob, record.top[:num_top], record.rank)
    rank = next(r for r, (t, _) in enumerate(record.top, start=1) if t == token_id)
    return TokenLogprobs(token_id, record.top[rank - 1][1], record.top[:num_top], rank)

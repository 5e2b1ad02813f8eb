"""Logits -> next tokens: grammar bitmasks (structured outputs), allowed tokens and bad words,
penalties, min_tokens, then greedy or temperature/top-k/top-p/min-p sampling. Seeded requests
draw from their own generator, so their stream is reproducible whatever else shares the batch.
In deterministic mode (`SamplingState.gumbel_seed`) a row's distribution is computed alone and
drawn from by Gumbel-max over hashed noise (gumbel.py), so its token depends only on its
logits, its seed and its position; speculative verification then accepts a draft where it is
that token, as for greedy rows, and gives exactly the tokens of plain decoding."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch

from chunkserve.core.messages import TokenLogprobs
from chunkserve.sampling_params import SamplingParams
from chunkserve.worker.gumbel import gumbel_argmax


@dataclass
class SamplingState:
    """What the sampler needs of one request; the runner keeps it for the request's life."""

    params: SamplingParams
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    eos_token_id: int | None
    generator: torch.Generator | None  # set when the request has a seed
    # prompt_logprobs: the records gathered so far, index i for prompt token i (None for the first, which
    # nothing predicts); None when not asked for, or once handed out with the first sampled token
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    gumbel_seed: int | None = None  # deterministic mode: the seed of the request's Gumbel-max draws

    @property
    def takes_chosen(self) -> bool:
        """Whether the token at each row is the row's chosen one (`_CheckedRows.chosen`: the
        argmax, or the Gumbel-max draw) rather than a draw from a generator."""
        return self.params.is_greedy or self.gumbel_seed is not None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class InvalidRowsError(ValueError):
    """Rows whose distribution is not one (NaN or infinite logits): nothing was drawn for any row."""

    def __init__(self, rows: list[int]) -> None:
        super().__init__(f"rows {rows} have no valid distribution to sample from")
        self.rows = rows


def sample(logits: torch.Tensor, states: list[SamplingState], default_generator: torch.Generator) -> list[int]:
    """logits: float32 [R, vocab], one row per state -> R token ids. Every row is checked
    before anything is drawn, so an InvalidRowsError leaves every generator untouched and the
    step can be retried without the rows it names."""
    return [run[0] for run in sample_runs(logits, states, [[] for _ in states], default_generator)]


def sample_runs(logits: torch.Tensor, states: list[SamplingState], drafts: list[list[int]],
                default_generator: torch.Generator,
                bitmasks: list[np.ndarray | None] | None = None) -> list[list[int]]:
    """Speculative verification: state i owns 1 + len(drafts[i]) consecutive rows of `logits`
    (float32 [rows, vocab]; row j scores the token after the state's tokens and its first j
    drafts). Returns per state its accepted drafts, then one token of its own: the target's
    choice at the first rejected draft, or after the last draft (the bonus token). Without
    drafts that is one sampled token per state.

    Greedy rows accept a draft while it is the argmax. Sampled rows use rejection sampling for a
    draft proposed deterministically (n-gram lookup, a greedy draft model): accept draft d with
    probability p(d) under the target's filtered distribution p, else draw from p without d
    (renormalised); the tokens are then distributed exactly as sampling from the target one at
    a time. A seeded request draws every uniform from its own generator.

    Penalties and min_tokens see a row's earlier drafts as the request's tokens, as they would
    be had those tokens been sampled one step at a time. `bitmasks[i]` (structured outputs):
    state i's grammar bitmask, one row per logits row it owns, applied first. Every row is
    checked before anything is drawn: an InvalidRowsError names states (not rows) and leaves
    every generator untouched."""
    if bitmasks is not None and any(mask is not None for mask in bitmasks):
        _mask_grammar(logits, _row_masks(bitmasks, drafts))
    row_states, owner = _expand_rows(states, drafts)
    _mask_banned(logits, row_states)
    _apply_penalties(logits, row_states)
    _mask_stops_before_min_tokens(logits, row_states)
    rows = _check_rows(logits, row_states, owner)
    runs: list[list[int]] = []
    last_draws: list[tuple[int, int]] = []  # (state index, row) of each run ending in _DRAWN_LATER
    first_row = 0  # the current state's first row
    for index, (state, state_drafts) in enumerate(zip(states, drafts)):
        run = _verify_drafts(state, state_drafts, first_row, rows, default_generator)
        if run[-1] == _DRAWN_LATER:
            last_draws.append((index, first_row + len(state_drafts)))
        runs.append(run)
        first_row += 1 + len(state_drafts)
    _draw_last_tokens(runs, last_draws, states, rows, default_generator)
    return runs


_DRAWN_LATER = -1  # a run's last token, drawn by _draw_last_tokens with every row that samples plainly


class _CheckedRows(NamedTuple):
    """The rows of one sample_runs call once every one was found valid."""

    chosen: list[int]  # each row's argmax, or for a deterministic row that samples, its Gumbel-max draw
    probs: torch.Tensor | None  # float64 [sampled rows, vocab]: the filtered distribution of each row that samples
    cdf: torch.Tensor | None  # probs' cumulative sums
    position: dict[int, int]  # row -> its index in probs and cdf


def _row_masks(bitmasks: list[np.ndarray | None], drafts: list[list[int]]) -> list[np.ndarray | None]:
    """Per-state grammar bitmasks -> one mask (or None) per logits row."""
    row_masks: list[np.ndarray | None] = []
    for mask, state_drafts in zip(bitmasks, drafts):
        row_masks.extend([None] * (1 + len(state_drafts)) if mask is None else list(mask))
    return row_masks


def _expand_rows(states: list[SamplingState], drafts: list[list[int]]) -> tuple[list[SamplingState], list[int]]:
    """One state per logits row (row j of a state sees its first j drafts as its own tokens), and
    each row's owner: the index of its state."""
    row_states: list[SamplingState] = []
    owner: list[int] = []
    for index, (state, state_drafts) in enumerate(zip(states, drafts)):
        row_states.append(state)
        row_states.extend(replace(state, token_ids=state.token_ids + state_drafts[:j])
                          for j in range(1, len(state_drafts) + 1))
        owner.extend([index] * (1 + len(state_drafts)))
    return row_states, owner


def _check_rows(logits: torch.Tensor, row_states: list[SamplingState], owner: list[int]) -> _CheckedRows:
    """Each row's chosen token (argmax, or Gumbel-max draw in deterministic mode) and, for the
    rows that sample, its filtered distribution; raises InvalidRowsError naming the owners of
    the rows with no valid distribution, before any draw."""
    chosen = logits.argmax(dim=-1)
    # argmax picks a NaN where a row has one, so checking the picked logits checks the greedy rows
    bad = (~logits.gather(1, chosen.unsqueeze(1)).squeeze(1).isfinite()).tolist()
    random_rows = [i for i, s in enumerate(row_states) if not s.params.is_greedy]
    probs = cdf = None
    chosen = chosen.tolist()
    if random_rows:
        probs = _random_rows_probs(logits, [row_states[i] for i in random_rows], random_rows)
        cdf = probs.cumsum(dim=-1)
        totals = cdf[:, -1]
        for row, valid in zip(random_rows, ((totals > 0) & totals.isfinite()).tolist()):
            bad[row] = not valid
    if any(bad):
        raise InvalidRowsError(sorted({owner[i] for i, b in enumerate(bad) if b}))
    for index, row in enumerate(random_rows):
        state = row_states[row]
        if state.gumbel_seed is not None:  # its position: the index its token will have in the sequence
            chosen[row] = gumbel_argmax(probs[index], state.gumbel_seed, len(state.token_ids))
    return _CheckedRows(chosen, probs, cdf, {row: i for i, row in enumerate(random_rows)})


def _random_rows_probs(logits: torch.Tensor, states: list[SamplingState], rows: list[int]) -> torch.Tensor:
    """The filtered distributions (float64) of the rows that sample: all at once, or in
    deterministic mode one row at a time, so that no row's numbers depend on the others."""
    if any(state.gumbel_seed is not None for state in states):
        return torch.cat([_filtered_probs(logits[row : row + 1], [state.params]) for row, state in zip(rows, states)]
                         ).double()
    return _filtered_probs(logits[rows], [state.params for state in states]).double()


def _verify_drafts(state: SamplingState, drafts: list[int], first_row: int, rows: _CheckedRows,
                   default_generator: torch.Generator) -> list[int]:
    """The state's accepted drafts, then the target's token at the first rejected one; where
    every draft is accepted, then _DRAWN_LATER for the token after the last (see sample_runs)."""
    for accepted, draft in enumerate(drafts):
        row = first_row + accepted
        if not _accepts(state, draft, row, rows, default_generator):
            return [*drafts[:accepted], _token_instead(state, draft, row, rows, default_generator)]
    return [*drafts, _DRAWN_LATER]


def _accepts(state: SamplingState, draft: int, row: int, rows: _CheckedRows,
             default_generator: torch.Generator) -> bool:
    """Greedy or deterministic: the draft is the row's chosen token. Sampled: a uniform draw
    accepts it with probability p(draft)."""
    if state.takes_chosen:
        return rows.chosen[row] == draft
    p = rows.probs[rows.position[row]]
    uniform = torch.rand(1, generator=state.generator or default_generator, dtype=torch.float64)
    return bool(uniform * p.sum() < p[draft])


def _token_instead(state: SamplingState, rejected: int, row: int, rows: _CheckedRows,
                   default_generator: torch.Generator) -> int:
    """The target's token at a rejected draft's row: the chosen one (greedy, deterministic), or
    a draw from the row's distribution without the rejected draft (renormalised)."""
    if state.takes_chosen:
        return rows.chosen[row]
    residual = rows.probs[rows.position[row]].clone()
    residual[rejected] = 0.0
    return int(_draw(residual.cumsum(dim=-1).unsqueeze(0), [state.generator], default_generator)[0])


def _draw_last_tokens(runs: list[list[int]], last_draws: list[tuple[int, int]], states: list[SamplingState],
                      rows: _CheckedRows, default_generator: torch.Generator) -> None:
    """Replaces the _DRAWN_LATER ending each run of `last_draws` with its row's token: the chosen
    one for greedy and deterministic states, one batched draw for the others. In place."""
    drawn = [(index, row) for index, row in last_draws if not states[index].takes_chosen]
    if drawn:
        tokens = _draw(rows.cdf[[rows.position[row] for _, row in drawn]], [states[i].generator for i, _ in drawn],
                       default_generator).tolist()
        for (index, _), token in zip(drawn, tokens):
            runs[index][-1] = token
    for index, row in last_draws:
        if states[index].takes_chosen:
            runs[index][-1] = rows.chosen[row]


def _mask_grammar(logits: torch.Tensor, row_masks: list[np.ndarray | None]) -> None:
    """Every token a row's grammar bitmask leaves out to -inf (bit t of word t // 32: token t
    allowed); rows without a mask are left alone. In place, row by row unless every row has a
    mask: gathering the masked rows and writing them back cost more (measured:
    docs/benchmarks-log.md, "Costs behind choices in the code")."""
    rows = [row for row, mask in enumerate(row_masks) if mask is not None]
    packed = np.ascontiguousarray(np.stack([row_masks[row] for row in rows]).astype("<i4", copy=False))
    allowed = np.unpackbits(packed.view(np.uint8), axis=1, bitorder="little")[:, : logits.shape[1]]
    refused = torch.from_numpy(allowed == 0)
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(refused, float("-inf"))
        return
    for index, row in enumerate(rows):
        logits[row].masked_fill_(refused[index], float("-inf"))


def _mask_banned(logits: torch.Tensor, states: list[SamplingState]) -> None:
    """Every token outside the request's allowed_token_ids, and the last token of each bad word
    whose other tokens end the output so far (the prompt does not count, as in vLLM), to -inf.
    In place."""
    for row, state in enumerate(states):
        params = state.params
        if params.allowed_token_ids is not None:
            allowed = torch.tensor(params.allowed_token_ids, dtype=torch.long)
            kept = logits[row, allowed]
            logits[row] = float("-inf")
            logits[row, allowed] = kept
        if params.bad_words_token_ids:
            output = state.token_ids[state.num_prompt_tokens :]
            banned = [word[-1] for word in params.bad_words_token_ids
                      if len(word) == 1 or output[len(output) - len(word) + 1 :] == word[:-1]]
            if banned:
                logits[row, banned] = float("-inf")


def _apply_penalties(logits: torch.Tensor, states: list[SamplingState]) -> None:
    """The request's logit bias, then the repetition penalty over prompt and output (Hugging
    Face's rule) and the presence and frequency penalties over the output (OpenAI's rule).
    In place."""
    for row, state in enumerate(states):
        params = state.params
        if not params.adjusts_logits:
            continue
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
            logits[row, ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype)
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(state.token_ids)), dtype=torch.long)
            values = logits[row, seen]
            logits[row, seen] = torch.where(
                values > 0, values / params.repetition_penalty, values * params.repetition_penalty
            )
        if params.presence_penalty or params.frequency_penalty:
            output = torch.tensor(state.token_ids[state.num_prompt_tokens :], dtype=torch.long)
            counts = torch.bincount(output, minlength=logits.shape[1]).to(logits.dtype)
            logits[row] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


def _mask_stops_before_min_tokens(logits: torch.Tensor, states: list[SamplingState]) -> None:
    for row, state in enumerate(states):
        if state.num_output_tokens >= state.params.min_tokens:
            continue
        stops = list(state.params.stop_token_ids)
        if state.eos_token_id is not None and not state.params.ignore_eos:
            stops.append(state.eos_token_id)
        if stops:
            logits[row, stops] = float("-inf")


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p filters -> probabilities [R, vocab]."""
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype).unsqueeze(1)
    logits = logits / temperature
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        logits = _top_k_top_p(logits, params)
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype).unsqueeze(1)
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]).unsqueeze(1)
    ranks = torch.arange(vocab).unsqueeze(0)
    drop = ranks >= top_k
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype).unsqueeze(1)
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before > top_p  # the most likely token always stays (mass before it is 0)
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def _draw(cdf: torch.Tensor, generators: list[torch.Generator | None],
          default_generator: torch.Generator) -> torch.Tensor:
    """One token per row of `cdf` (each row's cumulative probabilities), by inverse CDF: a
    uniform draw per row (from the row's own generator where it has one) located in the row's
    cumulative sum. One random number per row instead of one per vocab entry (exponential or
    multinomial noise), which on the CPU is several times cheaper (measured:
    docs/benchmarks-log.md, "Costs behind choices in the code"). The sum is float64: in
    float32, tokens below ~1e-8 next to a likely one add nothing to it and could never be drawn."""
    totals = cdf[:, -1:]
    uniform = torch.empty(len(generators), 1, dtype=torch.float64)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        uniform[unseeded] = torch.rand(len(unseeded), 1, generator=default_generator, dtype=torch.float64)
    for row, generator in enumerate(generators):
        if generator is not None:
            uniform[row] = torch.rand(1, generator=generator, dtype=torch.float64)
    # The first token whose cumulative sum exceeds u * total: one of nonzero probability, since
    # 0 <= u < 1 and u * total rounds below total.
    return torch.searchsorted(cdf, uniform * totals, right=True).squeeze(1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprobs]:
    """logprobs: [R, vocab] log-softmax rows -> each sampled token's logprob and rank, and the
    row's top-k. The rank (vLLM reports it) costs one comparison pass over the rows, as topk does."""
    top_values, top_ids = logprobs.topk(max(num_top), dim=-1) if max(num_top) else (None, None)
    sampled = logprobs.gather(1, torch.tensor(token_ids).unsqueeze(1))
    ranks = (logprobs >= sampled).sum(dim=1).tolist()
    sampled = sampled.squeeze(1).tolist()
    records = []
    for row, (token_id, k) in enumerate(zip(token_ids, num_top)):
        top = list(zip(top_ids[row, :k].tolist(), top_values[row, :k].tolist())) if k else []
        records.append(TokenLogprobs(token_id, sampled[row], top, ranks[row]))
    return records

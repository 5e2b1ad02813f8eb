"""A model of how long an engine step takes, fitted online from the engine's own steps.

SGLang fits f(l) = a*l^2 + b*l + c to a chunk's length for pipeline parallelism; we fit the
whole mixed step, because a step is decodes plus chunks:

    t = c + a_p * prefill_rows + a_d * decode_rows + b_p * prefill_attention + b_d * decode_attention
          + a_s * draft_rows + a_e * encoder_embeds + c_p * [the step has prompt rows]

where a chunk's attention work is the number of (query, key) pairs it scores, sum over its
tokens of the keys before them (quadratic in its length: SGLang's l^2 term), and a decode's
is its context length (its KV read). Prefill and decode attention get separate terms: the
first is compute (SDPA), the second a memory read. The fit is least squares on *relative*
error (each step's equation divided by its time), since a 20 ms decode step and a 1 s prefill
matter alike, with no negative coefficient (a term fitted negative is dropped and the rest
refitted), so predicted time grows with every input and the SLO budget can bisect on it.

Steps run slower than predicted now and then (the machine is shared, the host drifts); the
SLO budget plans with `margin`, the 99th percentile of actual / predicted over recent steps
(at least 1), so it aims below the SLO by as much as the model has recently been short. The
SLO is a P99 of the decodes' gaps, and each step is one gap of every decode: a margin at a
lower quantile leaves the slowest steps, which come in bursts of the host, over the SLO
(docs/benchmarks-log.md, adaptive chunking).

A p99 over a thousand steps still cannot see a burst coming: while the host runs slow for
a few seconds, every step's ratio is shifted up by its level, and the top of the shifted
spread crosses the long window's p99. So the margin (`SlowdownMargin`) also follows the host's
current level: the p99 scaled by the median of the last few ratios over the whole window's
median, never below the p99 itself. Replayed over recorded SLO runs (benchmarks/engine/margin_replay.py),
this leaves far fewer steps over their margin than a higher quantile of the same mean size (see
docs/benchmarks-log.md, "A margin that follows the host's level").

A step with prompt rows also costs a fixed amount more than one without (`c_p`): its linears
run as large GEMMs (oneDNN's, with their per-call setup), a decode-only step's as the small-batch
kernels; without the term, a 64-row chunk was predicted 30-40% short and a long one long by a fit
that had to make one line through both (docs/benchmarks-log.md, "Simulator accuracy").

Speculative decoding adds draft rows: a decode verifying k drafts is k + 1 decode rows, and
its k draft rows also count on their own (`a_s`), since its rows go through attention as one
multi-row query, which costs more per row than single-row decodes. The draft policy decides
with this model whether drafts pay, and drafts fitted as decode rows were predicted cheaper
than they ran (see docs/benchmarks-log.md, "Speculative decoding (2026-11-26, commit 2667759)").

Images add the vision encoder's work: a step that encodes images (before its forward) takes
longer by their encoder output rows (`encoder_embeds`, `a_e`); the chunk policy charges a chunk
the images it would encode, so `--tbt-slo-ms` holds while image prompts arrive.

Four windows keep recent steps: those that encode images, those with prompt rows, those with
draft rows, and the rest, so a long run of pure decode steps cannot push every prefill, draft
or encoder observation out (those terms would then be unknowable). A start-up profile
(`LLMEngine`) seeds the prompt and decode windows; draft rows and encoder rows are learned from
the first steps that have them (until then their cost is unknown and counted as 0).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from chunkserve.core.messages import ScheduledRequest
from chunkserve.core.stats import RankStepStats

FEATURE_NAMES = ("constant", "prefill_rows", "decode_rows", "prefill_attention", "decode_attention", "draft_rows",
                 "encoder_embeds", "prefill_step")
FEATURE_SCALE = np.array([1.0, 1e-3, 1e-3, 1e-6, 1e-6, 1e-3, 1e-3, 1.0])  # keeps the normal equations well conditioned


def chunk_attention(start: int, num_tokens: int) -> int:
    """(query, key) pairs scored by a chunk of `num_tokens` queries at positions start.. (causal)."""
    return num_tokens * start + num_tokens * (num_tokens + 1) // 2


@dataclass(frozen=True)
class StepShape:
    """The inputs of the step-time model for one step."""

    prefill_rows: int = 0
    decode_rows: int = 0
    prefill_attention: int = 0
    decode_attention: int = 0
    draft_rows: int = 0  # of the decode rows, draft tokens verified (what they cost beyond a decode row)
    encoder_embeds: int = 0  # encoder output rows computed for the step's images

    @classmethod
    def of(cls, scheduled: Iterable[ScheduledRequest], encoder_embeds: int = 0) -> StepShape:
        """A step's shape from its scheduled requests and the encoder rows it computes
        (`SchedulerOutput.num_encoder_embeds`)."""
        shape = cls(encoder_embeds=encoder_embeds)
        for s in scheduled:
            shape = shape.plus(s.num_computed_tokens, s.num_scheduled_tokens, s.is_decode)
        return shape

    @classmethod
    def of_rows(cls, rows: Iterable[tuple[int, int]]) -> StepShape:
        """From (start position, tokens) per request (a one-token row is a decode)."""
        shape = cls()
        for start, num_tokens in rows:
            shape = shape.plus(start, num_tokens)
        return shape

    def plus(self, start: int, num_tokens: int, is_decode: bool = False) -> StepShape:
        """This step with one more request's `num_tokens` rows computed from position `start`.
        A decode's rows (its last sampled token, plus any draft tokens to verify) read the KV as
        decodes do; so does a one-row chunk, which costs the same. Other rows are a chunk.

        A decode's draft rows also count apart: each needs logits, as a decode row does, but
        the request's rows go through attention as one multi-row query, which a decode row
        does not; their own term learns what that costs beyond a decode row."""
        if is_decode or num_tokens == 1:
            return StepShape(self.prefill_rows, self.decode_rows + num_tokens, self.prefill_attention,
                             self.decode_attention + chunk_attention(start, num_tokens),
                             self.draft_rows + num_tokens - 1, self.encoder_embeds)
        return StepShape(self.prefill_rows + num_tokens, self.decode_rows,
                         self.prefill_attention + chunk_attention(start, num_tokens), self.decode_attention,
                         self.draft_rows, self.encoder_embeds)

    def plus_encoder(self, num_embeds: int) -> StepShape:
        """This step with `num_embeds` more encoder output rows computed."""
        return dataclasses.replace(self, encoder_embeds=self.encoder_embeds + num_embeds)

    @property
    def counts(self) -> tuple[int, ...]:
        """The shape as plain ints (a step record's `shape`): FEATURE_NAMES order after the constant, up
        to the last (`prefill_step`, which follows from `prefill_rows`)."""
        return (self.prefill_rows, self.decode_rows, self.prefill_attention, self.decode_attention, self.draft_rows,
                self.encoder_embeds)

    @property
    def features(self) -> np.ndarray:
        raw = (1.0, self.prefill_rows, self.decode_rows, self.prefill_attention, self.decode_attention,
               self.draft_rows, self.encoder_embeds, 1.0 if self.prefill_rows else 0.0)
        return np.asarray(raw, dtype=np.float64) * FEATURE_SCALE


class SlowdownMargin:
    """How much slower than predicted the next step may run: the `quantile` of actual /
    predicted over the last `window` steps (recomputed by `update`), times the median of the
    last `level_window` ratios over the window's median when that is above 1; at least 1.
    Until the first `update` the quantile and median count as 1, so the first real steps are
    planned with the recent level alone."""

    def __init__(self, window: int = 1024, quantile: float = 0.99, level_window: int = 4) -> None:
        self._ratios: deque[float] = deque(maxlen=window)
        self._recent: deque[float] = deque(maxlen=level_window)
        self._quantile = quantile
        self._spread = 1.0  # the quantile over the window, as of the last update
        self._median = 1.0
        self._errors: tuple[float, float] | None = None  # `errors` as of the last update

    def record(self, ratio: float) -> None:
        self._ratios.append(ratio)
        self._recent.append(ratio)

    def update(self) -> None:
        if self._ratios:
            ratios = np.fromiter(self._ratios, dtype=np.float64)
            self._spread = float(np.quantile(ratios, self._quantile))
            self._median = float(np.median(ratios))
            self._errors = relative_error_quantiles(ratios)

    @property
    def value(self) -> float:
        # statistics.median: a handful of values, every step, where numpy's per-call overhead dominates
        level = statistics.median(self._recent) / self._median if self._recent else 1.0
        return max(1.0, self._spread, self._spread * level)

    @property
    def errors(self) -> tuple[float, float] | None:
        """(p50, p90) of |predicted - actual| / actual over the window as of the last `update`
        (computed there, not per step: every step record carries them); over the ratios so far
        before the first update that had any; None before any."""
        if self._errors is None and self._ratios:
            return relative_error_quantiles(np.fromiter(self._ratios, dtype=np.float64))
        return self._errors


def relative_error_quantiles(ratios: np.ndarray) -> tuple[float, float]:
    """(p50, p90) of |predicted - actual| / actual from ratios actual / predicted."""
    p50, p90 = np.quantile(np.abs(1.0 - 1.0 / ratios), (0.5, 0.9))  # |p - a| / a = |1 - p / a|
    return float(p50), float(p90)


class StepTimePredictor:
    def __init__(self, window: int = 256, refit_every: int = 8, error_window: int = 1024,
                 margin_quantile: float = 0.99, level_window: int = 4) -> None:
        self._with_encoder: deque[tuple[np.ndarray, float]] = deque(maxlen=window)
        self._with_prefill: deque[tuple[np.ndarray, float]] = deque(maxlen=window)
        self._with_drafts: deque[tuple[np.ndarray, float]] = deque(maxlen=window)
        self._decode_only: deque[tuple[np.ndarray, float]] = deque(maxlen=window)
        self._slowdown = SlowdownMargin(error_window, margin_quantile, level_window)  # of actual / predicted
        self._refit_every = refit_every
        self._since_fit = 0
        self.coefficients: np.ndarray | None = None  # seconds per scaled feature, FEATURE_NAMES order

    @property
    def fitted(self) -> bool:
        return self.coefficients is not None

    @property
    def margin(self) -> float:
        """What the SLO budget multiplies predictions by (`SlowdownMargin`): the p99 of actual /
        predicted, raised at once while the last few steps run slower than usual."""
        return self._slowdown.value

    def predict(self, shape: StepShape) -> float | None:
        """Predicted step time in seconds; None before the first fit."""
        if self.coefficients is None:
            return None
        return float(shape.features @ self.coefficients)

    def observe(self, shape: StepShape, seconds: float, count_error: bool = True) -> None:
        """Record a step; its relative prediction error counts towards `error_quantiles` and
        the margin unless `count_error` is False: a start-up profile, whose first steps are
        predicted by a fit of one or two others (errors of 10x), must not leave the SLO
        budget planning with a margin of 10x until a thousand real steps dilute it."""
        if seconds <= 0:
            return
        predicted = self.predict(shape)
        if predicted and count_error:
            self._slowdown.record(seconds / predicted)
        window = (self._with_encoder if shape.encoder_embeds else self._with_prefill if shape.prefill_rows
                  else self._with_drafts if shape.draft_rows else self._decode_only)
        window.append((shape.features, seconds))
        self._since_fit += 1
        if self.coefficients is None or self._since_fit >= self._refit_every:
            self.refit()

    def refit(self) -> None:
        samples = [*self._with_encoder, *self._with_prefill, *self._with_drafts, *self._decode_only]
        if not samples:
            return
        features = np.stack([f for f, _ in samples])
        times = np.array([t for _, t in samples])
        self.coefficients = fit_step_times(features, times)
        self._since_fit = 0
        self._slowdown.update()

    def describe(self) -> str:
        """The fitted model in readable units."""
        if self.coefficients is None:
            return "no fit yet"
        units = ("ms", "ms per 1k prefill rows", "ms per 1k decode rows", "ms per 1M prefill (query, key) pairs",
                 "ms per 1M decode context tokens", "ms per 1k draft rows", "ms per 1k encoder rows",
                 "ms per step with prompt rows")
        return " + ".join(f"{c * 1e3:.3g} {unit}" for c, unit in zip(self.coefficients, units))

    def error_quantiles(self) -> tuple[float, float] | None:
        """(p50, p90) of |predicted - actual| / actual over recent steps, as of the last refit;
        None before any."""
        return self._slowdown.errors


def observed_step_seconds(rank_stats: list[RankStepStats], pipeline_stages: int, wall_s: float) -> float:
    """What the step-time model learns from a step. One stage: its wall time. A pipeline: the
    time between a request's tokens if every micro-batch were like this one, stages x the slowest
    stage's own time, so that a TBT SLO sizes micro-batches that keep the stages evenly busy."""
    if pipeline_stages == 1 or not rank_stats:
        return wall_s
    return pipeline_stages * max(r.stage_s for r in rank_stats)


def fit_step_times(features: np.ndarray, times: np.ndarray) -> np.ndarray:
    """The model's coefficients (per scaled feature, `StepShape.features`) for steps of these
    features and seconds (also `chunkserve profile`'s offline fit).

    Least squares of sum(((features @ x) - t) / t)^2 with x >= 0: the most negative term
    is dropped and the rest refitted until none is negative.

    A term whose column is all zero in the data (no prefill seen yet), or equal to an earlier
    term's (only steps with prompt rows seen), gets 0: it is unknown, not free; the start-up
    profile makes sure every term has data."""
    weighted = features / times[:, None]
    active: list[int] = []  # terms with data of their own (all steps with prompt rows: prefill_step = constant)
    for i in range(features.shape[1]):
        if np.any(features[:, i]) and not any(np.array_equal(features[:, i], features[:, j]) for j in active):
            active.append(i)
    coefficients = np.zeros(features.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(weighted[:, active], np.ones(len(times)), rcond=None)
        if (solution >= 0).all():
            coefficients[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    return coefficients

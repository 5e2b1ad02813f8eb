"""The step-time model: it recovers a known cost law from observations, never fits a
negative cost, keeps prefill knowledge through long decode-only stretches, and reports its
own error."""

from __future__ import annotations

import random

import numpy as np
import pytest

from chunkserve.core.messages import ScheduledRequest
from chunkserve.core.step_predictor import SlowdownMargin, StepShape, StepTimePredictor, chunk_attention


def law(shape: StepShape) -> float:
    """A made-up machine: 5 ms a step, 1.5 ms per 1k prefill rows... in seconds."""
    return (5e-3 + 1.5e-3 * shape.prefill_rows + 0.4e-3 * shape.decode_rows
            + 2e-9 * shape.prefill_attention + 4e-8 * shape.decode_attention)


def random_shape(rng: random.Random, prefill: bool) -> StepShape:
    shape = StepShape()
    for _ in range(rng.randint(0, 32)):
        shape = shape.plus(rng.randint(10, 2000), 1)
    if prefill or shape.decode_rows == 0:
        shape = shape.plus(rng.randint(0, 4000), rng.randint(16, 512))
    return shape


def test_shape_counts_rows_and_attention_pairs():
    scheduled = [ScheduledRequest("d", 99, 1, [], False, True, True), ScheduledRequest("p", 32, 16, [], False, False, False)]
    shape = StepShape.of(scheduled)
    assert shape == StepShape(prefill_rows=16, decode_rows=1, prefill_attention=16 * 32 + 16 * 17 // 2,
                              decode_attention=100)
    assert chunk_attention(0, 3) == 1 + 2 + 3


def test_recovers_a_known_law_and_its_error_is_small():
    rng = random.Random(0)
    predictor = StepTimePredictor()
    assert predictor.predict(StepShape(prefill_rows=10)) is None and predictor.error_quantiles() is None
    for i in range(400):
        shape = random_shape(rng, prefill=i % 3 == 0)
        predictor.observe(shape, law(shape) * rng.uniform(0.98, 1.02))  # 2% noise
    for _ in range(50):
        shape = random_shape(rng, prefill=True)
        assert predictor.predict(shape) == pytest.approx(law(shape), rel=0.05)
    p50, p90 = predictor.error_quantiles()
    assert p50 <= p90 < 0.05


def test_no_coefficient_is_negative():
    rng = random.Random(1)
    predictor = StepTimePredictor()
    for _ in range(100):  # decode attention is free on this machine, and the noise is large
        shape = random_shape(rng, prefill=True)
        predictor.observe(shape, 5e-3 + 1e-6 * shape.prefill_rows * rng.uniform(0.5, 1.5))
    assert (predictor.coefficients >= 0).all()


def test_a_long_decode_only_stretch_keeps_the_prefill_terms():
    rng = random.Random(2)
    predictor = StepTimePredictor(window=64)
    for _ in range(64):
        shape = random_shape(rng, prefill=True)
        predictor.observe(shape, law(shape))
    for _ in range(1000):
        shape = random_shape(rng, prefill=False)
        if shape.prefill_rows == 0:
            predictor.observe(shape, law(shape))
    big_chunk = StepShape().plus(0, 512)
    assert predictor.predict(big_chunk) == pytest.approx(law(big_chunk), rel=0.01)


def test_draft_rows_cost_their_own_term_and_a_decode_only_stretch_keeps_it():
    """A decode verifying k drafts is k + 1 decode rows plus k draft rows: here a draft row
    costs 0.6 ms more than a decode row, which a model of decode rows alone would miss."""
    def with_drafts_law(shape: StepShape) -> float:
        return law(shape) + 0.6e-3 * shape.draft_rows

    rng = random.Random(4)
    predictor = StepTimePredictor(window=64)
    for _ in range(64):
        shape = random_shape(rng, prefill=False)
        for _ in range(rng.randint(1, 4)):  # requests verifying 1-5 drafts
            shape = shape.plus(rng.randint(10, 2000), 1 + rng.randint(1, 5), is_decode=True)
        predictor.observe(shape, with_drafts_law(shape))
    for _ in range(500):
        shape = random_shape(rng, prefill=False)
        predictor.observe(shape, with_drafts_law(shape))
    verifying = StepShape().plus(500, 1).plus(700, 5, is_decode=True)
    assert verifying.decode_rows == 6 and verifying.draft_rows == 4
    assert predictor.predict(verifying) == pytest.approx(with_drafts_law(verifying), rel=0.01)


def test_describe_names_the_units():
    predictor = StepTimePredictor()
    predictor.observe(StepShape(decode_rows=4, decode_attention=400), 0.02)
    assert "ms per 1k decode rows" in predictor.describe()
    assert np.isfinite(predictor.coefficients).all()


def test_margin_is_how_far_the_model_has_recently_fallen_short():
    predictor = StepTimePredictor(refit_every=1)
    shape = StepShape(prefill_rows=100)
    predictor.observe(shape, 0.1)
    assert predictor.margin == 1.0
    ratios = []
    for i in range(200):  # one step in fifty runs 30% slow: rare, but more than 1%
        seconds = 0.13 if i % 50 == 0 else 0.1
        ratios.append(seconds / predictor.predict(shape))
        predictor.observe(shape, seconds)
    assert 1.2 < predictor.margin < 1.3  # the budget plans for those steps, not for the typical one
    # the p99 of actual / predicted (the max would be 1.3); the last steps' level, at the
    # window's median, adds a tenth of a percent at most (each refit moves the prediction)
    assert predictor.margin == pytest.approx(np.quantile(ratios, 0.99), abs=2e-3)


def test_profile_steps_fit_the_model_but_leave_no_error_or_margin():
    """The profile's early steps are predicted from one or two others: 10x off. Counted, they
    would make the SLO budget plan at a tenth of the SLO until a thousand real steps pass."""
    predictor = StepTimePredictor(refit_every=1)
    for rows in (16, 128, 512):  # each predicted from the fit of the smaller ones before it
        shape = StepShape(prefill_rows=rows, prefill_attention=rows * rows // 2)
        predictor.observe(shape, rows * 1e-3 + rows**2 * 1e-6, count_error=False)
    predictor.refit()
    assert predictor.fitted and predictor.margin == 1.0 and predictor.error_quantiles() is None
    predictor.observe(StepShape(prefill_rows=128, prefill_attention=128 * 128 // 2), 0.15)
    assert predictor.error_quantiles() is not None


def test_margin_rises_with_the_first_steps_of_a_slow_spell_and_falls_after_it():
    """A p99 over a thousand steps barely moves when the host turns 25% slower for a few
    seconds; the margin must follow at once, or every step of the spell runs over the SLO."""
    predictor = StepTimePredictor(refit_every=8)
    shape = StepShape(prefill_rows=100)
    rng = random.Random(3)
    for _ in range(400):
        predictor.observe(shape, 0.1 * rng.uniform(0.95, 1.05))
    steady = predictor.margin
    assert steady == pytest.approx(1.05, abs=0.03)
    for _ in range(3):  # the spell: 3 steps of 1000, which barely move the p99 of the window
        predictor.observe(shape, 0.1 * 1.25 * rng.uniform(0.95, 1.05))
    assert predictor.margin > 1.15 * steady
    for _ in range(3):
        predictor.observe(shape, 0.1 * rng.uniform(0.95, 1.05))
    assert predictor.margin == pytest.approx(steady, rel=0.05)


def test_slowdown_margin_never_falls_below_the_quantile_or_one():
    margin = SlowdownMargin(window=100, quantile=0.99, level_window=4)
    assert margin.value == 1.0
    for ratio in [0.8] * 100:  # the model overestimates: no margin below 1
        margin.record(ratio)
    margin.update()
    assert margin.value == 1.0
    for ratio in [1.0] * 96 + [1.4] * 4:
        margin.record(ratio)
    margin.update()
    spread = margin.value  # the last 4 are the slow ones: the level lifts the p99
    assert spread == pytest.approx(np.quantile([1.0] * 96 + [1.4] * 4, 0.99) * 1.4 / 1.0)
    for ratio in [0.8] * 4:  # a fast spell does not lower the margin below the p99
        margin.record(ratio)
    assert margin.value == pytest.approx(np.quantile([1.0] * 96 + [1.4] * 4, 0.99))
    still = SlowdownMargin(level_window=0)  # no level: the plain quantile
    for ratio in [1.0] * 98 + [1.5] * 2:
        still.record(ratio)
    still.update()
    assert still.value == pytest.approx(np.quantile([1.0] * 98 + [1.5] * 2, 0.99))

"""A profile: fitted from step records, saved and read back, refused when malformed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from chunkserve.core.step_predictor import StepShape
from chunkserve.errors import InvalidRequestError
from chunkserve.sim.profile import StepTimeProfile, fit_profile
from tests.sim.support import PROFILE


def records_from(profile: StepTimeProfile, noise: np.ndarray, gap_s: float) -> list[dict]:
    """Step records of a run whose steps take exactly the profile's time times `noise`."""
    rng = np.random.default_rng(0)
    records, clock = [], 1.79e9
    for ratio in noise:
        shape = StepShape.of_rows([(int(rng.integers(0, 1500)), 1) for _ in range(int(rng.integers(0, 9)))]
                                  + [(int(rng.integers(0, 1024)), int(rng.integers(2, 512)))] * int(rng.integers(0, 2))
                                  or [(10, 1)])
        seconds = profile.predict(shape) * ratio
        records.append({"start_time": clock, "duration_s": seconds, "shape": list(shape.counts)})
        clock += seconds + gap_s
    return records


def test_the_fit_recovers_the_coefficients_residuals_and_gap_of_the_steps_it_reads():
    noise = np.random.default_rng(1).lognormal(0.0, 0.05, size=600)
    profile = fit_profile(records_from(PROFILE, noise, 0.002))
    for name, value in PROFILE.coefficients.items():
        assert profile.coefficients[name] == pytest.approx(value, rel=0.15), name
    assert np.median(profile.residuals) == pytest.approx(1.0, abs=0.02)
    assert len(profile.residuals) == 600 and profile.step_gap_s == pytest.approx(0.002)


def test_records_without_a_shape_or_from_a_pipeline_are_not_fitted():
    records = records_from(PROFILE, np.ones(20), 0.0)
    old = [{k: v for k, v in r.items() if k != "shape"} for r in records]
    with pytest.raises(InvalidRequestError, match="usable step records"):
        fit_profile(old)
    pipelined = [{**r, "request_ids": ["a"]} for r in records]
    assert len(fit_profile(records + pipelined).residuals) == 20


def test_a_profile_survives_its_file(tmp_path):
    path = str(tmp_path / "profile.json")
    PROFILE.save(path)
    assert StepTimeProfile.load(path) == PROFILE
    assert json.load(open(path))["format"] == 1


def test_a_profile_from_another_device_needs_only_its_coefficients(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"coefficients": {"constant": 0.004, "prefill_rows": 2e-5, "decode_rows": 1e-4},
                                "provenance": {"cpu": "none: an H200's vLLM step log, refitted"}}))
    profile = StepTimeProfile.load(str(path))
    assert profile.predict(StepShape(prefill_rows=1000, decode_rows=10)) == pytest.approx(0.004 + 0.02 + 0.001)
    assert profile.residuals == (1.0,) and profile.step_gap_s == 0.0


@pytest.mark.parametrize("raw, named", [
    ({"coefficients": {"per_token": 1.0}}, "per_token"),
    ({"coefficients": {"constant": -1.0}}, "constant"),
    ({"coefficients": {}, "residuals": []}, "residuals"),
    ({"coefficients": {}, "slowness": 2}, "slowness"),
    ({"format": 7, "coefficients": {}}, "format"),
    ({}, "coefficients"),
    ({"coefficients": {}, "kv_link": {"rate": 1e9}}, "kv_link"),
    ({"coefficients": {}, "kv_link": {"bytes_per_s": 1e9, "latency_s": -1}}, "latency_s"),
])
def test_a_malformed_profile_is_refused_naming_the_field(tmp_path, raw, named):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(InvalidRequestError, match=named):
        StepTimeProfile.load(str(path))

"""A step-time profile: how long engine steps take on one machine, for `chunkserve sim`.

The profile is the step-time model of core/step_predictor.py fitted offline, plus what the
model alone cannot say:

- `residuals`: each fitted step's actual / predicted seconds, in step order. The simulator
  multiplies its predictions by runs of them, so the host's bursts (which make TBT tails and
  eat SLO margins) come back in the simulated run as they came in the measured one.
- `step_gap_s`: the engine loop's time between one step's end and the next one's start while
  it has work (handing outputs to the frontend, taking new requests in).
- `request_latency_s` and `output_latency_s`: a request's way from the client into the engine
  core (HTTP, tokenizing, the frontend's queue) and a token's way back out. These are not in a
  step trace; `chunkserve profile --bench-result` measures their sum from a benchmark run of
  the same trace, else they count as 0 and the output says so.
- `kv_bytes_per_block` and `provenance`: what the profile describes (CPU, model, dtype, ops,
  TP/PP, chunkserve commit), printed with every simulated result.
- `draft_acceptance_rate`: accepted over verified draft tokens in the fitted steps (speculative
  decoding; none without drafts), the rate a simulated n-gram speculation's drafts hold at.
- `kv_link`: the wire between prefill and decode instances (`--pd P:D`), `bytes_per_s` and
  `latency_s` (sim/link.py), measured by `chunkserve profile --measure-link`; none: not measured.

The file is JSON (`format` 1), written by `chunkserve profile`; a profile from another device
needs only `coefficients` (seconds per unit of each term: a constant, per prefill row, per
decode row, per prefill (query, key) pair, per decode context token, per draft row, per encoder
row, per step with prompt rows), the rest defaulting to none (`residuals` [1.0]), so a vLLM or
SGLang step log refitted to these terms, or BLIS's beta coefficients (constant, prefill rows,
decode rows), can be imported by hand. docs/SIMULATOR.md documents the fields.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from chunkserve.core.step_predictor import FEATURE_NAMES, FEATURE_SCALE, StepShape, fit_step_times
from chunkserve.errors import InvalidRequestError
from chunkserve.sim.link import LinkModel

PROFILE_FORMAT = 1


@dataclass(frozen=True)
class StepTimeProfile:
    coefficients: dict[str, float]  # seconds per unit of each FEATURE_NAMES term
    residuals: tuple[float, ...] = (1.0,)  # actual / predicted of the fitted steps, in step order
    step_gap_s: float = 0.0
    request_latency_s: float = 0.0
    output_latency_s: float = 0.0
    kv_bytes_per_block: int | None = None
    block_size: int = 16
    kv_link: dict[str, float] | None = None  # LinkModel's fields
    draft_acceptance_rate: float | None = None  # accepted / verified draft tokens of the fitted run (None: no drafts)
    provenance: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.coefficients) - set(FEATURE_NAMES)
        if unknown:
            raise InvalidRequestError(f"profile coefficients {sorted(unknown)} are not step-time terms; the terms "
                                      f"are {', '.join(FEATURE_NAMES)}")
        for name, value in self.coefficients.items():
            if not (math.isfinite(value) and value >= 0):
                raise InvalidRequestError(f"profile coefficient {name} must be a finite number >= 0, got {value}")
        if not self.residuals or not all(math.isfinite(r) and r > 0 for r in self.residuals):
            raise InvalidRequestError("profile residuals must be a non-empty list of positive ratios")
        for name in ("step_gap_s", "request_latency_s", "output_latency_s"):
            if not getattr(self, name) >= 0:
                raise InvalidRequestError(f"profile {name} must be >= 0, got {getattr(self, name)}")
        if self.kv_link is not None:
            self.link()  # a malformed link is refused when the profile is read, not at --pd
        if self.draft_acceptance_rate is not None and not 0.0 <= self.draft_acceptance_rate <= 1.0:
            raise InvalidRequestError(f"profile draft_acceptance_rate must be in [0, 1], got {self.draft_acceptance_rate}")

    def link(self) -> LinkModel | None:
        """The measured KV link between prefill and decode instances (None: not measured)."""
        if self.kv_link is None:
            return None
        try:
            return LinkModel(**self.kv_link)
        except TypeError:
            raise InvalidRequestError(f"profile kv_link must have bytes_per_s and latency_s, got {self.kv_link}") from None

    @property
    def scaled_coefficients(self) -> np.ndarray:
        """The coefficients as core/step_predictor.py's model holds them (per scaled feature)."""
        return np.array([self.coefficients.get(name, 0.0) for name in FEATURE_NAMES]) / FEATURE_SCALE

    def predict(self, shape: StepShape) -> float:
        """The step's seconds by the fitted model (before any residual)."""
        return float(shape.features @ self.scaled_coefficients)

    def describe(self) -> str:
        where = self.provenance
        parts = [where.get(key) for key in ("cpu", "model", "dtype", "source")]
        return "; ".join(str(p) for p in parts if p) or "no provenance"

    def to_json(self) -> dict[str, Any]:
        return {"format": PROFILE_FORMAT, **asdict(self), "residuals": list(self.residuals)}

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> StepTimeProfile:
        if raw.get("format", PROFILE_FORMAT) != PROFILE_FORMAT:
            raise InvalidRequestError(f"profile format {raw.get('format')!r} is not {PROFILE_FORMAT}")
        if not isinstance(raw.get("coefficients"), dict):
            raise InvalidRequestError("a profile needs `coefficients`: seconds per unit of each step-time term")
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(raw) - known - {"format"}
        if unknown:
            raise InvalidRequestError(f"profile fields {sorted(unknown)} are not known; known: {sorted(known)}")
        values = {key: value for key, value in raw.items() if key in known}
        if "residuals" in values:
            values["residuals"] = tuple(float(r) for r in values["residuals"])
        return cls(**values)

    @classmethod
    def load(cls, path: str) -> StepTimeProfile:
        try:
            with open(path) as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as error:
            raise InvalidRequestError(f"profile {path!r} could not be read: {error}") from None
        return cls.from_json(raw)


@dataclass(frozen=True)
class TracedStep:
    """What the fit reads of one step record of a `--trace-steps` file."""

    start_time: float
    duration_s: float
    shape: StepShape

    @classmethod
    def of_record(cls, record: dict[str, Any]) -> TracedStep | None:
        """None for a record the fit cannot use: written before records carried their shape, or
        a pipelined step (whose duration overlaps others')."""
        counts = record.get("shape")
        if not counts or record.get("request_ids") or record["duration_s"] <= 0:
            return None
        return cls(record["start_time"], record["duration_s"], StepShape(*counts))


def read_trace(path: str) -> list[dict[str, Any]]:
    """The step records of a `--trace-steps` file (or a simulated run's), in file order."""
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError) as error:
        raise InvalidRequestError(f"step trace {path!r} could not be read: {error}") from None


def fit_profile(records: list[dict[str, Any]], max_gap_s: float = 0.25, **fields: Any) -> StepTimeProfile:
    """The profile of the steps of one or more traces (each a list of records in step order;
    concatenated here). `step_gap_s` is the median gap between consecutive steps under
    `max_gap_s` (longer gaps are the engine idling between requests). `fields` fill the rest."""
    steps = [s for s in map(TracedStep.of_record, records) if s is not None]
    if len(steps) < len(FEATURE_NAMES):
        raise InvalidRequestError(f"{len(steps)} usable step records: a profile needs at least {len(FEATURE_NAMES)} "
                                  "(traces from chunkserve before step records carried `shape` cannot be fitted)")
    features = np.stack([s.shape.features for s in steps])
    times = np.array([s.duration_s for s in steps])
    scaled = fit_step_times(features, times)
    predicted = features @ scaled
    residuals = tuple(float(r) for r in times / np.maximum(predicted, 1e-9))
    gaps = [b.start_time - a.start_time - a.duration_s for a, b in zip(steps, steps[1:])]
    busy = [g for g in gaps if 0 <= g < max_gap_s]
    coefficients = {name: float(c) for name, c in zip(FEATURE_NAMES, scaled * FEATURE_SCALE)}
    drafted = sum(r.get("num_draft_tokens", 0) for r in records)
    accepted = sum(r.get("num_accepted_tokens", 0) for r in records)
    return StepTimeProfile(coefficients, residuals, float(np.median(busy)) if busy else 0.0,
                           draft_acceptance_rate=accepted / drafted if drafted else None, **fields)

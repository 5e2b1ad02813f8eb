"""How long simulated steps take: by a profile (`ProfileTimer`) or as a real run's were (`ReplayTimer`).

Both are the simulated executor's `StepTimer` plus the engine loop's gap after each step. A
timer reads nothing of the host: the same inputs give the same seconds on any machine.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from chunkserve.core.messages import SchedulerOutput
from chunkserve.core.step_predictor import StepShape
from chunkserve.errors import InvalidRequestError
from chunkserve.sim.profile import StepTimeProfile

RESIDUAL_RUN_STEPS = 32  # consecutive residuals drawn together: the host's bursts last about this long
# An engine with requests but nothing it may schedule now (a prompt held back by the TBT SLO until the
# prefill-wait guard lets it through) loops until it may: in simulation, time moves on by this much a turn.
IDLE_TURN_S = 0.001


class ProfileTimer:
    """The profile's prediction for each step times a residual. Residuals are drawn in runs of
    `run_steps` consecutive ones from a random place in the profile's sequence (seeded), so a
    burst of slow steps in the profiled run is a burst here too, not spread thin."""

    def __init__(self, profile: StepTimeProfile, seed: int | tuple[int, ...] = 0,
                 run_steps: int = RESIDUAL_RUN_STEPS) -> None:
        self.profile = profile
        self._rng = np.random.default_rng(seed)
        self._run_steps = run_steps
        self._next = 0
        self._left = 0

    def _residual(self) -> float:
        residuals = self.profile.residuals
        if self._left == 0:
            self._next = int(self._rng.integers(len(residuals)))
            self._left = self._run_steps
        value = residuals[self._next % len(residuals)]
        self._next += 1
        self._left -= 1
        return value

    def step_seconds(self, scheduler_output: SchedulerOutput) -> float:
        shape = StepShape.of(scheduler_output.scheduled, scheduler_output.num_encoder_embeds)
        return self.profile.predict(shape) * self._residual()

    def profile_seconds(self, shape: StepShape) -> float:
        return self.profile.predict(shape)

    def gap_seconds(self) -> float:
        return self.profile.step_gap_s

    def idle_seconds(self) -> float:
        return max(self.profile.step_gap_s, IDLE_TURN_S)


class ReplayTimer:
    """A recorded run's steps, one by one: step i takes record i's `duration_s`, and the gap after
    it is what the real engine loop took before step i + 1 began. A simulation on it makes the
    decisions the real engine made, step for step, if the simulator is the engine."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        if not records:
            raise InvalidRequestError("a replay needs the recorded run's step records")
        self.records = records
        self.step = 0

    def step_seconds(self, scheduler_output: SchedulerOutput) -> float:
        if self.step >= len(self.records):
            raise InvalidRequestError(f"the replay ran past the {len(self.records)} recorded steps: the simulated "
                                      "run scheduled differently from the recorded one")
        return self.records[self.step]["duration_s"]

    def profile_seconds(self, shape: StepShape) -> float:
        raise InvalidRequestError("a replay cannot time the start-up profile (it is not in a step trace): replay "
                                  "runs without --tbt-slo-ms, --ttft-slo-ms or automatic speculation")

    def idle_seconds(self) -> float:
        return IDLE_TURN_S

    def gap_seconds(self) -> float:
        """The gap after the step just timed (0 after the last)."""
        record = self.records[self.step]
        self.step += 1
        if self.step >= len(self.records):
            return 0.0
        following = self.records[self.step]
        return max(0.0, following["start_time"] - record["start_time"] - record["duration_s"])

"""Where the engine core reads the time: the host's clocks, or a simulated clock.

The engine core stamps arrivals, step starts, step durations and outputs; everything that
decides (the prefill-wait guard, the step-time model the SLO budgets plan with) reads those
stamps. So a core given a `VirtualClock` runs its real scheduling on simulated time
(`chunkserve sim`), and no host time can leak into it: a simulator whose virtual clock
picked up the predictor's own wall time reported TTFTs 40% off (sgl-project/sglang#39042).
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def time(self) -> float:
        """Seconds since the epoch: arrival times, step records, output timestamps."""

    def perf_counter(self) -> float:
        """Seconds on a monotonic clock: step starts."""

    def since(self, start: float) -> float:
        """Seconds from `start` (a `perf_counter()` value) to now: step durations."""


class SystemClock:
    """The host's clocks."""

    def time(self) -> float:
        return time.time()

    def perf_counter(self) -> float:
        return time.perf_counter()

    def since(self, start: float) -> float:
        return time.perf_counter() - start


SYSTEM_CLOCK = SystemClock()


class VirtualClock:
    """Simulated seconds: they move only when the simulation says so, never with the host.

    A duration is the sum of the advances since its start, not a difference of two times: at
    epoch-sized times a difference loses the low bits, and a replay must hand the step-time
    model exactly the durations the real engine measured."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self._mark = start  # the last perf_counter() read
        self._since_mark = 0.0  # seconds advanced since it

    def time(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        self._mark, self._since_mark = self.now, 0.0
        return self.now

    def since(self, start: float) -> float:
        return self._since_mark if start == self._mark else self.now - start

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds} s)")
        self.now += seconds
        self._since_mark += seconds

    def advance_to(self, when: float) -> None:
        """Move to `when` if it is later (an idle engine waits for the next arrival)."""
        if when > self.now:
            self._since_mark += when - self.now
            self.now = when  # exactly: what waits for `when` must find it reached

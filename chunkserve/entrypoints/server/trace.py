"""The step trace: one JSON line per engine step, written by an AsyncLLM step observer on
the thread that receives the engine's events. A line costs a json.dumps and a buffered write (see
benchmarks/engine/trace_overhead.py for the measured cost), so it can stay on in production."""

from __future__ import annotations

import json
from typing import TextIO

from chunkserve.core.stats import SchedulerStats
from chunkserve.engine.outputs import RequestOutput, StepRecord

FLUSH_EVERY_STEPS = 64  # a reader tailing the file sees steps at most this late


class StepTraceWriter:
    def __init__(self, path: str) -> None:
        self.path = path
        self._file: TextIO = open(path, "a", encoding="utf-8")
        self._unflushed = 0

    def observe(self, record: StepRecord | None, outputs: list[RequestOutput], stats: SchedulerStats) -> None:
        if record is None:
            return
        self._file.write(json.dumps(record.to_dict()) + "\n")
        self._unflushed += 1
        if self._unflushed >= FLUSH_EVERY_STEPS or not stats.num_running + stats.num_waiting:
            self._file.flush()
            self._unflushed = 0

    def close(self) -> None:
        self._file.close()

"""The periodic one-line stats log (vLLM's LoggingStatLogger), so a server's state shows in
its log without a Prometheus: at the first step after each `interval_s` (steps run while
requests do; an idle server logs nothing).

    Engine: avg prompt throughput: 412.0 tokens/s, avg generation throughput: 96.3 tokens/s,
    running: 8 reqs, waiting: 0 reqs, KV cache usage: 12.5%, prefix cache hit rate: 43.1%

Prompt throughput counts prompt tokens computed (a prefix-cache hit costs nothing and counts
nothing), generation throughput tokens produced, both over the interval.
"""

from __future__ import annotations

import logging
import time

from chunkserve.core.stats import SchedulerStats
from chunkserve.engine.outputs import RequestOutput, StepRecord

logger = logging.getLogger("chunkserve.stats")
INTERVAL_S = 10.0


class StatsLogger:
    def __init__(self, interval_s: float = INTERVAL_S, clock=time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._since = clock()
        self._prompt_tokens = 0
        self._generation_tokens = 0

    def observe(self, record: StepRecord | None, outputs: list[RequestOutput], stats: SchedulerStats) -> None:
        """An AsyncLLM step observer (runs after every step)."""
        if record is not None:
            self._prompt_tokens += record.num_prefill_tokens
        self._generation_tokens += sum(len(o.outputs[0].new_token_ids) for o in outputs)
        elapsed = self._clock() - self._since
        if elapsed >= self.interval_s:
            logger.info(self.line(stats, elapsed))
            self._since = self._clock()
            self._prompt_tokens = self._generation_tokens = 0

    def line(self, stats: SchedulerStats, elapsed_s: float) -> str:
        return (f"Engine: avg prompt throughput: {self._prompt_tokens / elapsed_s:.1f} tokens/s, avg generation "
                f"throughput: {self._generation_tokens / elapsed_s:.1f} tokens/s, running: {stats.num_running} reqs, "
                f"waiting: {stats.num_waiting} reqs, KV cache usage: {100 * stats.kv_cache_usage:.1f}%, "
                f"prefix cache hit rate: {100 * stats.prefix_cache_hit_rate:.1f}%")

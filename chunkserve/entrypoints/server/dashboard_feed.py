"""What /dashboard shows, kept on the server (dashboard.py serves the page and its event stream).

The feed is a step observer (on the frontend's output thread) that keeps nothing until a viewer
has asked for a snapshot, and stops again IDLE_AFTER_S after the last one, so a server nobody
watches pays one comparison a step. While watched, each step appends its record's
fields the page draws to a ring of the last `max_steps`, moves the rows of the requests in
flight (prompt progress from the record's `prompt_chunks`, tokens from the request outputs),
and adds the step's token gaps and first tokens to the latency windows. A viewer asks for what
came after the last step it saw (`snapshot`), at most `max_steps_per_snapshot` of them (the
newest; the answer counts the ones left out), with the totals of that moment and percentiles
over a window. So the feed's memory is its ring, its windows and one row per request in
flight, whatever the viewers do: a viewer that never reads holds nothing, one that falls
behind skips steps, and the step loop (in the engine core's process) never waits for any.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from chunkserve.bench.dashboard_page import STEP_FIELDS
from chunkserve.bench.metrics import ms_distribution
from chunkserve.core.stats import SchedulerStats
from chunkserve.engine.async_llm import client_request_id
from chunkserve.engine.outputs import RequestOutput, StepRecord

MAX_STEPS = 4096  # the ring: over ten seconds at hundreds of steps a second
MAX_STEPS_PER_SNAPSHOT = 400
MAX_WINDOW_S = 600.0
MAX_GAPS = 100_000  # token gaps in the latency window (the oldest go first)
MAX_FIRST_TOKENS = 10_000
MAX_ROWS = 1024  # requests in flight with a row (a server takes more than this only under overload)
ROWS_SHOWN = 64  # the oldest in flight, in each snapshot
IDLE_AFTER_S = 60.0  # without a snapshot asked for this long, the feed stops keeping steps (and forgets them)


@dataclass
class _Row:
    request_id: str
    arrival: float
    prompt_len: int
    computed: int = 0
    chunks: int = 0
    generated: int = 0
    max_tokens: int | None = None


class DashboardFeed:
    def __init__(self, token_budget: int, tbt_slo_ms: float | None, max_steps: int = MAX_STEPS,
                 clock: Callable[[], float] = time.time) -> None:
        self.token_budget = token_budget
        self.tbt_slo_ms = tbt_slo_ms
        self._clock = clock
        self._lock = threading.Lock()
        self._steps: deque[dict[str, Any]] = deque(maxlen=max_steps)
        self._rows: dict[str, _Row] = {}
        self._gaps: deque[tuple[float, float]] = deque(maxlen=MAX_GAPS)  # (when, seconds since the last token)
        self._first_tokens: deque[tuple[float, float]] = deque(maxlen=MAX_FIRST_TOKENS)  # (when, TTFT seconds)
        self._stats: SchedulerStats | None = None
        self.closed = False  # the server is stopping: viewers' streams end
        self._watched_until = float("-inf")  # when the feed stops keeping steps unless a viewer asks again

    def close(self) -> None:
        self.closed = True

    # ----- the step observer ---------------------------------------------------------------------

    def observe(self, record: StepRecord | None, outputs: list[RequestOutput], stats: SchedulerStats) -> None:
        if self._clock() > self._watched_until:
            if self._steps or self._rows:
                self._forget()
            return
        with self._lock:
            self._stats = stats
            if record is not None:
                self._steps.append({name: getattr(record, name) for name in STEP_FIELDS}
                                   | {"forward_mode": record.forward_mode.value})
                for core_id, start, tokens, prompt_len in record.prompt_chunks:  # (the outputs name the caller's id)
                    row = self._row(client_request_id(core_id), prompt_len, record.start_time)
                    row.computed, row.chunks = min(start + tokens, prompt_len), row.chunks + 1
            for output in outputs:
                self._observe_output(output)

    def _forget(self) -> None:
        with self._lock:
            self._steps.clear()
            self._rows.clear()
            self._gaps.clear()
            self._first_tokens.clear()

    def _row(self, request_id: str, prompt_len: int, arrival: float) -> _Row:
        row = self._rows.get(request_id)
        if row is None:
            if len(self._rows) >= MAX_ROWS:
                del self._rows[next(iter(self._rows))]
            row = self._rows[request_id] = _Row(request_id, arrival, prompt_len)
        return row

    def _observe_output(self, output: RequestOutput) -> None:
        metrics = output.metrics
        if output.finished:
            self._rows.pop(output.request_id, None)
        else:
            row = self._row(output.request_id, len(output.prompt_token_ids), metrics.arrival_time)
            row.arrival, row.computed = metrics.arrival_time, row.prompt_len  # (its prompt is done: it has tokens)
            row.generated, row.max_tokens = len(metrics.token_times), metrics.max_tokens
        count = len(output.outputs[0].new_token_ids) if output.outputs else 0
        times = metrics.token_times
        if not count or len(times) < count:
            return
        if len(times) == count:
            self._first_tokens.append((times[0], times[0] - metrics.arrival_time))
        else:  # one gap per step that brought tokens (several with accepted drafts), as /metrics counts them
            self._gaps.append((times[-1], times[-1] - times[-count - 1]))

    # ----- what a viewer reads ------------------------------------------------------------------

    def snapshot(self, after: int = -1, window_s: float = 60.0) -> dict[str, Any]:
        """The steps after step `after` (newest `MAX_STEPS_PER_SNAPSHOT`; `skipped`: how many
        more there were), the scheduler's state, TBT and TTFT percentiles over the last
        `window_s` seconds, and the oldest requests in flight."""
        window_s = min(max(window_s, 1.0), MAX_WINDOW_S)
        now = self._clock()
        self._watched_until = now + IDLE_AFTER_S
        with self._lock:  # (held for copies only: the output thread waits for nothing else)
            steps = []
            for step in reversed(self._steps):  # (newest first, to the first one seen already)
                if step["step_id"] <= after:
                    break
                steps.append(step)
            gaps = _since(self._gaps, now - window_s)
            first_tokens = _since(self._first_tokens, now - window_s)
            rows = sorted(self._rows.values(), key=lambda r: r.arrival)
            stats = self._stats
        steps.reverse()
        kept = steps[-MAX_STEPS_PER_SNAPSHOT:]
        return {
            "time": now,
            "token_budget": self.token_budget,
            "tbt_slo_ms": self.tbt_slo_ms,
            "steps": kept,
            "skipped": len(steps) - len(kept),
            "last_step": steps[-1]["step_id"] if steps else after,
            "window_s": window_s,
            "tbt_ms": ms_distribution(gaps),
            "ttft_ms": ms_distribution(first_tokens),
            "state": None if stats is None else _state(stats),
            "requests": [vars(row) for row in rows[:ROWS_SHOWN]],
            "requests_in_flight": len(rows),
        }


def _since(timed: deque[tuple[float, float]], start: float) -> list[float]:
    """The values of `timed` (oldest first) stamped at `start` or later, newest first: the walk
    stops at the first older one."""
    values = []
    for when, value in reversed(timed):
        if when < start:
            break
        values.append(value)
    return values


def _state(stats: SchedulerStats) -> dict[str, Any]:
    state = {
        "running": stats.num_running, "waiting": stats.num_waiting, "preempted": stats.num_preempted_waiting,
        "kv_blocks": stats.num_blocks, "kv_blocks_used": stats.num_blocks - stats.num_free_blocks,
        "kv_blocks_free": stats.num_free_blocks, "kv_blocks_cached": stats.num_cached_blocks,
        "prefix_cache_hit_rate": stats.prefix_cache_hit_rate, "preemptions_total": stats.num_preemptions_total,
        "spec_decode": None, "kv_transfer": None,
    }
    if stats.spec_decode is not None:
        spec = stats.spec_decode
        state["spec_decode"] = {"draft_tokens": spec.num_draft_tokens, "accepted_tokens": spec.num_accepted_tokens,
                                "acceptance_rate": spec.num_accepted_tokens / spec.num_draft_tokens
                                if spec.num_draft_tokens else None,
                                "mean_acceptance_length": spec.mean_acceptance_length}
    if stats.kv_transfer is not None:
        transfer = stats.kv_transfer
        state["kv_transfer"] = {"role": transfer.role, "bootstrapping": transfer.num_bootstrapping,
                                "transferring": transfer.num_transferring, "bytes_total": transfer.bytes_total,
                                "transfers_total": transfer.transfers_total, "failed_total": transfer.failed_total}
    return state

"""/dashboard's aggregation (entrypoints/server/dashboard_feed.py): what a viewer is sent, over
which window, and that nothing a viewer does (or does not do) grows the server's memory."""

from __future__ import annotations

import pytest

from chunkserve.core.messages import ForwardMode
from chunkserve.core.stats import SchedulerStats, SpecDecodeStats
from chunkserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, StepRecord
from chunkserve.entrypoints.server import dashboard_feed
from chunkserve.entrypoints.server.dashboard_feed import DashboardFeed


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


STATS = SchedulerStats(num_running=3, num_waiting=2, num_preempted_waiting=1, num_free_blocks=60, num_blocks=100,
                       num_preemptions_total=4, prefix_cache_queries_total=200, prefix_cache_hits_total=50,
                       num_cached_blocks=30, spec_decode=SpecDecodeStats(5, 10, 7))


def record(step_id: int, start: float, decode: int = 2, prefill: int = 0,
           chunks: tuple[tuple[str, int, int, int], ...] = ()) -> StepRecord:
    return StepRecord(step_id=step_id, start_time=start, duration_s=0.01, predicted_duration_s=0.009,
                      prediction_error_p50=None, prediction_error_p90=None, slo_margin=1.0, prefill_wait_guard=False,
                      forward_mode=ForwardMode.MIXED if prefill and decode else ForwardMode.DECODE,
                      num_prefill_tokens=prefill, num_decode_tokens=decode, num_requests=decode + len(chunks),
                      num_preemptions=0, kv_cache_usage=0.4, prefix_cache_queries=0, prefix_cache_hits=0,
                      prefix_cache_hit_rate=0.25, prompt_chunks=chunks)


def output(request_id: str, token_times: list[float], new: int, arrival: float, prompt_len: int = 10,
           finished: bool = False) -> RequestOutput:
    completion = CompletionOutput(0, "", list(range(len(token_times))), new_token_ids=list(range(new)))
    return RequestOutput(request_id, None, list(range(prompt_len)), [completion], finished,
                         RequestMetrics(arrival, token_times=list(token_times), max_tokens=20))


def watched_feed(clock: Clock) -> DashboardFeed:
    feed = DashboardFeed(token_budget=64, tbt_slo_ms=100.0, clock=clock)
    feed.snapshot()  # a viewer is there: the feed keeps steps
    return feed


def test_a_viewer_gets_each_step_once_with_the_state_and_the_budget():
    clock = Clock()
    feed = watched_feed(clock)
    for step in range(5):
        feed.observe(record(step, clock.now + step * 0.01), [], STATS)
    first = feed.snapshot(after=-1)
    assert [s["step_id"] for s in first["steps"]] == [0, 1, 2, 3, 4] and first["last_step"] == 4
    assert first["token_budget"] == 64 and first["tbt_slo_ms"] == 100.0
    assert first["state"] | {"spec_decode": None} == {
        "running": 3, "waiting": 2, "preempted": 1, "kv_blocks": 100, "kv_blocks_used": 40, "kv_blocks_free": 60,
        "kv_blocks_cached": 30, "prefix_cache_hit_rate": 0.25, "preemptions_total": 4, "spec_decode": None,
        "kv_transfer": None}
    assert first["state"]["spec_decode"]["acceptance_rate"] == pytest.approx(0.7)
    feed.observe(record(5, clock.now), [], STATS)
    assert [s["step_id"] for s in feed.snapshot(after=first["last_step"])["steps"]] == [5]
    assert feed.snapshot(after=5)["steps"] == []


def test_prompt_progress_chunk_by_chunk_then_tokens_then_gone():
    clock = Clock()
    feed = watched_feed(clock)
    feed.observe(record(0, clock.now, prefill=64, chunks=(("long", 0, 64, 200),)), [], STATS)
    feed.observe(record(1, clock.now, prefill=64, chunks=(("long", 64, 64, 200),)), [], STATS)
    (row,) = feed.snapshot()["requests"]
    assert (row["request_id"], row["computed"], row["prompt_len"], row["chunks"], row["generated"]) == (
        "long", 128, 200, 2, 0)
    feed.observe(record(2, clock.now, prefill=72, chunks=(("long", 128, 72, 200),)),
                 [output("long", [clock.now], 1, clock.now - 1, prompt_len=200)], STATS)
    (row,) = feed.snapshot()["requests"]
    assert (row["computed"], row["chunks"], row["generated"], row["max_tokens"]) == (200, 3, 1, 20)
    feed.observe(record(3, clock.now), [output("long", [clock.now, clock.now + 1], 1, clock.now - 1, 200, True)],
                 STATS)
    assert feed.snapshot()["requests"] == []


def test_latency_percentiles_cover_the_window_asked_for_only():
    clock = Clock()
    feed = watched_feed(clock)
    start = clock.now
    # request a: arrives at start, first token after 0.5 s, then a token every 0.1 s for 20 s
    times = [start + 0.5]
    feed.observe(None, [output("a", times, 1, start)], STATS)
    for _ in range(200):
        times.append(times[-1] + 0.1)
        feed.observe(None, [output("a", times, 1, start)], STATS)
    # the last 5 s: a token every 0.3 s
    for _ in range(17):
        times.append(times[-1] + 0.3)
        feed.observe(None, [output("a", times, 1, start)], STATS)
    clock.now = times[-1]
    recent = feed.snapshot(window_s=5.0)
    assert recent["tbt_ms"]["p50"] == pytest.approx(300.0) and recent["tbt_ms"]["count"] == 17
    assert recent["ttft_ms"]["count"] == 0  # the first token is older than 5 s
    whole = feed.snapshot(window_s=60.0)
    assert whole["tbt_ms"]["count"] == 217 and whole["tbt_ms"]["p50"] == pytest.approx(100.0)
    assert {key: whole["ttft_ms"][key] for key in ("p50", "p99", "count")} == {
        "p50": pytest.approx(500.0), "p99": pytest.approx(500.0), "count": 1}


def test_a_viewer_that_never_reads_costs_a_bounded_ring_and_one_behind_skips_steps(monkeypatch):
    monkeypatch.setattr(dashboard_feed, "MAX_GAPS", 1000)
    clock = Clock()
    feed = DashboardFeed(64, None, max_steps=500, clock=clock)
    feed.snapshot()
    times = [clock.now]
    for step in range(20_000):
        times.append(times[-1] + 0.001)
        feed.observe(record(step, clock.now, chunks=((f"r{step}", 0, 8, 100),)),
                     [output("streaming", times[-2:], 1, clock.now)], STATS)
    assert len(feed._steps) == 500 and len(feed._rows) <= dashboard_feed.MAX_ROWS
    behind = feed.snapshot(after=-1)
    assert len(behind["steps"]) == dashboard_feed.MAX_STEPS_PER_SNAPSHOT
    assert behind["skipped"] == 500 - dashboard_feed.MAX_STEPS_PER_SNAPSHOT and behind["last_step"] == 19_999
    assert len(behind["requests"]) == dashboard_feed.ROWS_SHOWN and behind["requests_in_flight"] == dashboard_feed.MAX_ROWS


def test_nobody_watching_keeps_nothing_and_a_viewer_gone_idle_is_forgotten():
    clock = Clock()
    feed = DashboardFeed(64, None, clock=clock)
    feed.observe(record(0, clock.now, chunks=(("r", 0, 8, 100),)), [], STATS)
    assert feed.snapshot()["steps"] == [] and feed.snapshot()["requests"] == []  # (asking starts the watch)
    feed.observe(record(1, clock.now), [], STATS)
    assert [s["step_id"] for s in feed.snapshot()["steps"]] == [1]
    clock.now += dashboard_feed.IDLE_AFTER_S + 1
    feed.observe(record(2, clock.now), [], STATS)
    assert not feed._steps and not feed._rows

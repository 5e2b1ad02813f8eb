"""Benchmark metrics on synthetic token times with known answers, and the workload generators."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from chunkserve.bench.client import RequestResult
from chunkserve.bench.metrics import distribution, gaps_in_window, interference_summary, summarize
from chunkserve.bench.serve import add_arguments
from chunkserve.bench.workloads import build_workload


def request(send: float, token_times: list[float], end: float | None = None, ok: bool = True,
            kind: str = "normal", prompt_len: int = 10) -> RequestResult:
    return RequestResult(kind=kind, prompt_len=prompt_len, output_len=len(token_times), send_time=send,
                         token_times=token_times, end_time=token_times[-1] if end is None else end, ok=ok,
                         error=None if ok else "HTTP 500: boom", completion_tokens=len(token_times))


def bench_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--base-url", "http://unused", *flags])


def test_distribution_uses_linear_interpolation():
    stats = distribution(range(1, 101))
    assert stats["p50"] == pytest.approx(50.5)
    assert stats["p90"] == pytest.approx(90.1)
    assert stats["p99"] == pytest.approx(99.01)
    assert (stats["max"], stats["mean"], stats["count"]) == (100.0, 50.5, 100)


def test_distribution_of_nothing_is_empty():
    assert distribution([]) == {"p50": None, "p90": None, "p99": None, "max": None, "mean": None, "count": 0}


def test_latencies_of_known_token_times():
    results = [
        request(100.0, [100.1, 100.2, 100.3, 100.4], end=100.5),  # TTFT 100, TBT 100 x3, TPOT 100, E2E 500
        request(200.0, [200.3, 200.5, 201.5], end=201.6),  # TTFT 300, TBT 200 and 1000, TPOT 600, E2E 1600
        request(300.0, [300.2], end=300.2),  # TTFT 200, no TBT, no TPOT, E2E 200
    ]
    summary = summarize(results)
    assert summary["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert summary["ttft_ms"]["max"] == pytest.approx(300.0)
    assert summary["tbt_ms"]["count"] == (4 - 1) + (3 - 1) + (1 - 1)
    assert summary["tbt_ms"]["p50"] == pytest.approx(100.0)
    assert summary["tbt_ms"]["max"] == pytest.approx(1000.0)
    assert summary["tbt_ms"]["mean"] == pytest.approx((3 * 100 + 200 + 1000) / 5)
    assert summary["tpot_ms"]["count"] == 2
    assert summary["tpot_ms"]["max"] == pytest.approx(600.0)
    assert summary["tpot_ms"]["p50"] == pytest.approx(350.0)
    assert summary["e2e_ms"]["max"] == pytest.approx(1600.0)
    assert summary["e2e_ms"]["p50"] == pytest.approx(500.0)


def test_throughput_spans_first_send_to_last_end():
    results = [request(10.0, [10.5, 11.0], prompt_len=100), request(12.0, [12.5, 13.0, 14.0], prompt_len=50)]
    summary = summarize(results)
    assert summary["duration_s"] == pytest.approx(4.0)
    assert summary["request_throughput"] == pytest.approx(2 / 4.0)
    assert summary["output_token_throughput"] == pytest.approx(5 / 4.0)
    assert summary["total_token_throughput"] == pytest.approx((150 + 5) / 4.0)


def test_goodput_counts_exactly_the_requests_meeting_every_slo():
    results = [
        request(0.0, [0.1, 0.2, 0.3]),  # meets both
        request(0.0, [0.15, 0.25]),  # meets both
        request(0.0, [0.5, 0.6]),  # TTFT 500 ms misses
        request(0.0, [0.1, 0.2, 0.6, 0.7]),  # one 400 ms gap misses TBT
        request(0.0, [0.1, 0.2], ok=False),  # failed
    ]
    duration = 0.7
    summary = summarize(results, slo_ttft_ms=200, slo_tbt_ms=150)
    assert summary["num_meeting_slo"] == 2
    assert summary["goodput"] == pytest.approx(2 / duration)
    assert (summary["completed"], summary["failed"]) == (4, 1)
    assert summarize(results, slo_ttft_ms=200)["num_meeting_slo"] == 3
    assert summarize(results, slo_tbt_ms=150)["num_meeting_slo"] == 3
    no_slo = summarize(results)
    assert no_slo["num_meeting_slo"] == 4
    assert no_slo["goodput"] == pytest.approx(no_slo["request_throughput"])


def test_interference_window_runs_from_first_long_send_to_last_long_first_token():
    stream = request(0.0, [1.0, 2.0, 3.0, 6.0, 7.0, 9.0, 13.0, 14.0], kind="stream")
    longs = [request(2.5, [5.5, 5.6], kind="long"), request(8.0, [12.0, 12.1], kind="long")]
    block = interference_summary([stream, *longs])
    assert block["window"] == [2.5, 12.0]
    # Gaps overlapping [2.5, 12.0]: 2->3, 3->6, 6->7, 7->9, 9->13 (ends after the window closes).
    assert block["tbt_during_long_ms"]["count"] == 5
    assert block["tbt_during_long_ms"]["max"] == pytest.approx(4000.0)
    assert block["stream_tbt_ms"]["count"] == 7
    assert block["long_ttft_ms"]["p50"] == pytest.approx(3500.0)
    assert block["long_ttft_ms"]["max"] == pytest.approx(4000.0)
    assert block["long_send_times"] == [2.5, 8.0]
    assert gaps_in_window(stream, 6.5, 6.9) == [1.0]


def test_interference_without_a_long_first_token_has_no_window():
    block = interference_summary([request(0.0, [1.0, 2.0], kind="stream"),
                                  request(0.5, [0.9], ok=False, kind="long")])
    assert block["window"] is None
    assert block["tbt_during_long_ms"]["count"] == 0
    assert block["stream_tbt_ms"]["count"] == 1


def test_sharegpt_like_lengths_are_heavy_tailed_around_the_requested_medians():
    args = bench_args("--workload", "sharegpt-like", "--num-prompts", "4000", "--input-len", "200",
                      "--output-len", "50", "--vocab-size", "1000")
    specs = build_workload(args, np.random.default_rng(0))
    inputs = np.array([len(s.prompt_token_ids) for s in specs])
    outputs = np.array([s.output_len for s in specs])
    assert np.median(inputs) == pytest.approx(200, rel=0.1)
    assert np.median(outputs) == pytest.approx(50, rel=0.1)
    assert 4 <= inputs.min() and inputs.max() <= 800 and 4 <= outputs.min() and outputs.max() <= 200
    # A uniform length distribution has p99/p50 < 2 (at most (1 + r) / 1 with r <= 1).
    assert np.percentile(inputs, 99) / np.median(inputs) > 3
    assert np.percentile(outputs, 99) / np.median(outputs) > 3


def test_random_workload_lengths_ids_and_poisson_arrivals():
    args = bench_args("--num-prompts", "2000", "--input-len", "100", "--output-len", "20", "--range-ratio", "0.5",
                      "--request-rate", "50", "--vocab-size", "1000")
    specs = build_workload(args, np.random.default_rng(0))
    inputs = [len(s.prompt_token_ids) for s in specs]
    assert min(inputs) >= 50 and max(inputs) <= 150 and min(s.output_len for s in specs) >= 10
    assert all(100 <= t < 900 for s in specs for t in s.prompt_token_ids)
    send_ats = np.array([s.send_at for s in specs])
    assert send_ats[0] == 0.0 and np.all(np.diff(send_ats) >= 0)
    assert np.mean(np.diff(send_ats)) == pytest.approx(1 / 50, rel=0.1)
    same = build_workload(args, np.random.default_rng(0))
    assert [s.prompt_token_ids for s in same] == [s.prompt_token_ids for s in specs]


def test_interference_workload_schedule():
    args = bench_args("--workload", "interference", "--streams", "3", "--long-prompts", "2", "--long-len", "40",
                      "--long-start", "1.5", "--long-every", "2.0")
    specs = build_workload(args, np.random.default_rng(0))
    assert [(s.kind, s.send_at) for s in specs] == [("stream", 0.0)] * 3 + [("long", 1.5), ("long", 3.5)]
    assert [len(s.prompt_token_ids) for s in specs[3:]] == [40, 40]


def test_prefix_workload_shares_its_prefixes_in_turn():
    args = bench_args("--workload", "prefix", "--num-prompts", "6", "--prefix-len", "50", "--num-prefixes", "2",
                      "--input-len", "10", "--output-len", "4")
    specs = build_workload(args, np.random.default_rng(0))
    assert [len(s.prompt_token_ids) for s in specs] == [60] * 6 and {s.kind for s in specs} == {"prefix"}
    prefixes = [tuple(s.prompt_token_ids[:50]) for s in specs]
    assert prefixes[0::2] == [prefixes[0]] * 3 and prefixes[1::2] == [prefixes[1]] * 3 and prefixes[0] != prefixes[1]
    assert len({tuple(s.prompt_token_ids[50:]) for s in specs}) == 6


def test_multi_turn_workload_resends_the_history_after_the_previous_turn():
    args = bench_args("--workload", "multi-turn", "--num-prompts", "2", "--turns", "3", "--prefix-len", "30",
                      "--input-len", "10", "--output-len", "5", "--think-time", "0.5")
    specs = build_workload(args, np.random.default_rng(0))
    assert [len(s.prompt_token_ids) for s in specs] == [40, 55, 70] * 2
    assert [s.after for s in specs] == [None, 0, 1, None, 3, 4]
    assert [s.send_at for s in specs if s.after is not None] == [0.5] * 4
    for turn in (1, 2, 4, 5):
        previous, current = specs[turn - 1].prompt_token_ids, specs[turn].prompt_token_ids
        assert current[: len(previous)] == previous
    assert specs[0].prompt_token_ids[:30] == specs[3].prompt_token_ids[:30]  # one system prompt for all chats


def test_prefix_cache_hit_rate_counts_the_requests_that_report_it():
    reporting = request(0.0, [1.0, 1.1], end=1.2)
    reporting.prompt_len, reporting.cached_tokens = 100, 64
    silent = request(0.0, [1.0, 1.1], end=1.2)
    assert summarize([reporting, silent])["prefix_cache_hit_rate"] == pytest.approx(0.64)
    assert summarize([silent])["prefix_cache_hit_rate"] is None

"""Latency, throughput and goodput of a benchmark run, from the client's token times (no I/O).

Per request: TTFT = first token time - send time; TBT = every gap between consecutive tokens
(n token events give n - 1 samples, so one stall shows up as one large sample instead of being
averaged away); TPOT = (last - first token time) / (n - 1); E2E = end time - send time.
Latency statistics use the completed (ok) requests only; the summary reports them in ms.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from chunkserve.bench.client import RequestResult

PERCENTILES = {"p50": 50, "p90": 90, "p99": 99}


def ttft(result: RequestResult) -> float | None:
    """Seconds from sending to the first token; None when no token came."""
    return result.token_times[0] - result.send_time if result.token_times else None


def gaps(times: list[float]) -> list[float]:
    """Differences between consecutive times: n times give n - 1 gaps."""
    return [b - a for a, b in zip(times, times[1:])]


def tbt_gaps(result: RequestResult) -> list[float]:
    """Seconds between consecutive tokens of one request."""
    return gaps(result.token_times)


def tpot(result: RequestResult) -> float | None:
    """Mean seconds per output token after the first; None with fewer than 2 tokens."""
    times = result.token_times
    return (times[-1] - times[0]) / (len(times) - 1) if len(times) >= 2 else None


def e2e(result: RequestResult) -> float:
    """Seconds from sending to the end of the response."""
    return result.end_time - result.send_time


def distribution(values: Iterable[float]) -> dict:
    """p50/p90/p99 (linear interpolation), max, mean and count; all None (count 0) when empty."""
    array = np.asarray(list(values), dtype=float)
    if array.size == 0:
        return {**{key: None for key in PERCENTILES}, "max": None, "mean": None, "count": 0}
    stats = {key: float(np.percentile(array, q)) for key, q in PERCENTILES.items()}
    return {**stats, "max": float(array.max()), "mean": float(array.mean()), "count": int(array.size)}


def ms_distribution(seconds: Iterable[float | None]) -> dict:
    """``distribution`` of the given seconds in milliseconds, skipping the missing ones."""
    return distribution(1000.0 * s for s in seconds if s is not None)


def meets_slo(result: RequestResult, slo_ttft_ms: float | None, slo_tbt_ms: float | None) -> bool:
    """Completed, TTFT within its SLO and every TBT gap (its max) within its SLO; unset SLOs always hold."""
    if not result.ok:
        return False
    first = ttft(result)
    if slo_ttft_ms is not None and (first is None or 1000.0 * first > slo_ttft_ms):
        return False
    return slo_tbt_ms is None or all(1000.0 * gap <= slo_tbt_ms for gap in tbt_gaps(result))


def summarize(results: list[RequestResult], slo_ttft_ms: float | None = None,
              slo_tbt_ms: float | None = None) -> dict:
    """The run's summary: counts, throughputs over duration_s, goodput and latency distributions in ms.

    duration_s spans the first send to the last end; goodput is the requests per second that
    completed and met every SLO given (with none given it equals request_throughput).
    """
    done = [r for r in results if r.ok]
    duration = max(r.end_time for r in results) - min(r.send_time for r in results) if results else 0.0
    num_meeting_slo = sum(meets_slo(r, slo_ttft_ms, slo_tbt_ms) for r in results)
    output_tokens = sum(r.completion_tokens for r in done)
    prompt_tokens = sum(r.prompt_len for r in done)
    reporting = [r for r in done if r.cached_tokens is not None]
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "request_throughput": per_second(len(done), duration),
        "output_token_throughput": per_second(output_tokens, duration),
        "total_token_throughput": per_second(prompt_tokens + output_tokens, duration),
        "goodput": per_second(num_meeting_slo, duration),
        "num_meeting_slo": num_meeting_slo,
        "ttft_ms": ms_distribution(ttft(r) for r in done),
        "tbt_ms": ms_distribution(gap for r in done for gap in tbt_gaps(r)),
        "tpot_ms": ms_distribution(tpot(r) for r in done),
        "e2e_ms": ms_distribution(e2e(r) for r in done),
        # Prompt tokens the server read from its prefix cache, over the requests that reported it.
        "prefix_cache_hit_rate": (sum(r.cached_tokens for r in reporting) / sum(r.prompt_len for r in reporting)
                                  if reporting else None),
    }


def per_second(count: float, duration_s: float) -> float:
    """count / duration_s, 0 for an empty run."""
    return count / duration_s if duration_s > 0 else 0.0


def long_prompt_window(results: list[RequestResult]) -> tuple[float, float] | None:
    """(first long prompt's send time, last first token of a long prompt), or None if no long prompt got one."""
    longs = [r for r in results if r.kind == "long"]
    firsts = [r.token_times[0] for r in longs if r.ok and r.token_times]
    if not firsts:
        return None
    return min(r.send_time for r in longs), max(firsts)


def gaps_in_window(result: RequestResult, start: float, end: float) -> list[float]:
    """The TBT gaps that overlap [start, end]: a stall that began before a long prompt arrived, or
    that ended with the step which finished its prefill, is the stall that prompt caused."""
    times = result.token_times
    return [b - a for a, b in zip(times, times[1:]) if b > start and a < end]


def interference_summary(results: list[RequestResult]) -> dict:
    """How the long prompts stalled the streams: stream TBT inside the long-prompt window and
    over the whole run, and the long prompts' own TTFT (all in ms)."""
    streams = [r for r in results if r.kind == "stream" and r.ok]
    longs = [r for r in results if r.kind == "long"]
    window = long_prompt_window(results)
    during = [g for r in streams for g in gaps_in_window(r, *window)] if window else []
    return {
        "tbt_during_long_ms": ms_distribution(during),
        "stream_tbt_ms": ms_distribution(g for r in streams for g in tbt_gaps(r)),
        "long_ttft_ms": ms_distribution(ttft(r) for r in longs if r.ok),
        "long_send_times": [r.send_time for r in longs],
        "window": list(window) if window else None,
    }

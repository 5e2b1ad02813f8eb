"""`chunkserve bench plot` on synthetic results and a synthetic step trace."""

from __future__ import annotations

import argparse
import json
import logging

import pytest

from chunkserve.bench.plot import add_arguments, clip_to_runs, main, make_figures, tbt_gaps_ms

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BENCH_START = 1_700_000_000.0
MS_TOLERANCE = 1e-3  # wall-clock floats near 1.7e9 s resolve about 0.24 us


def _request(kind: str, send: float, token_times: list[float], ok: bool = True) -> dict:
    return {"kind": kind, "prompt_len": 2048 if kind == "long" else 64, "output_len": len(token_times),
            "send_time": BENCH_START + send, "token_times": [BENCH_START + t for t in token_times],
            "end_time": BENCH_START + (token_times[-1] if token_times else send), "ok": ok,
            "error": None if ok else "boom", "completion_tokens": len(token_times)}


def _stream_times(stall_gap: float) -> list[float]:
    """20 ms between tokens, except `stall_gap` between tokens while the long prompt (sent at 1 s) runs."""
    times, t = [], 0.1
    while t < 3.0:
        times.append(t)
        t += stall_gap if 1.0 <= t < 1.8 else 0.02
    return times


def _interference_result(label: str, stall_gap: float, long_ttft: float) -> dict:
    requests = [_request("stream", 0.05, _stream_times(stall_gap)),
                _request("long", 1.0, [1.0 + long_ttft, 1.0 + long_ttft + 0.02])]
    return {"label": label, "workload": "interference", "config": {}, "base_url": "http://x", "model": "m",
            "bench_start": BENCH_START, "summary": {},
            "interference": {"tbt_during_long_ms": {}, "stream_tbt_ms": {}, "long_ttft_ms": {},
                             "long_send_times": [BENCH_START + 1.0]},
            "requests": requests}


def _cumulative(start: float, gaps: list[float]) -> list[float]:
    times = [start]
    for gap in gaps:
        times.append(times[-1] + gap)
    return times


def _random_result() -> dict:
    """Five requests of 20 tokens with gaps of 15 to 23 ms, and a failed one whose gap is not counted."""
    requests = [_request("normal", i * 0.1, _cumulative(i * 0.1 + 0.05, [0.015 + 0.002 * (k % 5) for k in range(19)]))
                for i in range(5)]
    requests.append(_request("normal", 0.6, [0.7, 0.9], ok=False))
    return {"label": "random", "workload": "random", "config": {}, "base_url": "http://x", "model": "m",
            "bench_start": BENCH_START, "summary": {}, "interference": None, "requests": requests}


def _results() -> list[dict]:
    return [_interference_result("chunking off", 0.8, 0.8), _interference_result("chunked 256", 0.06, 1.1),
            _random_result()]


def _trace() -> list[dict]:
    steps, t = [], BENCH_START
    for step_id in range(60):
        prefill = 256 if 20 <= step_id < 28 else 0
        decode = 4 if step_id < 50 else 1
        duration = 0.02 + prefill * 0.0002
        mode = "MIXED" if prefill and decode else ("EXTEND" if prefill else "DECODE")
        steps.append({"step_id": step_id, "start_time": t, "duration_s": duration, "forward_mode": mode,
                      "num_prefill_tokens": prefill, "num_decode_tokens": decode, "num_requests": decode + bool(prefill),
                      "num_preemptions": int(step_id == 25), "kv_cache_usage": step_id / 100})
        t += duration + 0.001
    return steps


def _assert_png(path, width: int = 800, height: int = 450) -> None:
    from matplotlib.image import imread

    with open(path, "rb") as file:
        assert file.read(8) == PNG_SIGNATURE
    assert imread(str(path)).shape[:2] == (height, width)


def test_make_figures_writes_every_figure(tmp_path):
    paths = make_figures(_results(), {"chunked-256": _trace()}, str(tmp_path / "figs"))
    names = sorted(path.rsplit("/", 1)[-1] for path in paths)
    assert names == ["steps_chunked-256.png", "tbt_cdf.png", "timeline.png"]
    for path in paths:
        _assert_png(path)


def test_figures_without_inputs_are_skipped_with_a_log_line(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="chunkserve.bench.plot"):
        paths = make_figures([_random_result()], {}, str(tmp_path))
    assert [path.rsplit("/", 1)[-1] for path in paths] == ["tbt_cdf.png"]
    assert "skipping timeline.png" in caplog.text
    assert "skipping steps_<label>.png" in caplog.text


def test_tbt_gaps_are_the_token_time_differences_of_successful_requests():
    gaps = tbt_gaps_ms(_interference_result("chunking off", 0.8, 0.8))
    assert len(gaps) == (len(_stream_times(0.8)) - 1) + 1  # the stream's gaps and the long prompt's one
    assert max(gaps) == pytest.approx(800.0, abs=MS_TOLERANCE)
    assert min(gaps) == pytest.approx(20.0, abs=MS_TOLERANCE)
    random_gaps = tbt_gaps_ms(_random_result())
    assert len(random_gaps) == 5 * 19
    assert min(random_gaps) == pytest.approx(15.0, abs=MS_TOLERANCE)
    assert max(random_gaps) == pytest.approx(23.0, abs=MS_TOLERANCE)


def test_a_result_without_a_required_key_is_a_clear_error(tmp_path):
    result = _random_result()
    del result["bench_start"]
    with pytest.raises(ValueError, match=r"results\[0\].*bench_start"):
        make_figures([result], {}, str(tmp_path))


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_main_reads_result_and_trace_files(tmp_path):
    result_paths = []
    for index, result in enumerate(_results()):
        result_paths.append(tmp_path / f"result{index}.json")
        result_paths[-1].write_text(json.dumps(result))
    trace_path = tmp_path / "chunked.jsonl"
    trace_path.write_text("".join(json.dumps(step) + "\n" for step in _trace()))
    out_dir = tmp_path / "new" / "figs"
    main(_parse([*map(str, result_paths), "--trace", str(trace_path), "-o", str(out_dir)]))
    assert sorted(p.name for p in out_dir.iterdir()) == ["steps_chunked.png", "tbt_cdf.png", "timeline.png"]
    for path in out_dir.iterdir():
        _assert_png(path)


def test_main_names_the_file_missing_a_key(tmp_path, capsys):
    result = _interference_result("chunking off", 0.8, 0.8)
    del result["interference"]["long_send_times"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(result))
    with pytest.raises(SystemExit) as exit_info:
        main(_parse([str(path), "-o", str(tmp_path / "figs")]))
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert str(path) in error and "long_send_times" in error


def test_clip_to_runs_keeps_the_steps_inside_a_result_run():
    steps = _trace()  # 60 steps from BENCH_START, about 1.9 s in all
    result = _random_result()  # runs from BENCH_START to its last request's end (0.9 s)
    kept = clip_to_runs(steps, [result])
    last_end = max(r["end_time"] for r in result["requests"])
    assert kept == [s for s in steps if s["start_time"] <= last_end] and 0 < len(kept) < len(steps)
    later = {**result, "bench_start": BENCH_START + 100.0}
    assert clip_to_runs(steps, [later]) == []

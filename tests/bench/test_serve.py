"""`chunkserve bench serve` end to end against a real server on the tiny model.

The server sleeps STEP_DELAY_MS before each step: a request of n tokens takes at least n steps,
which gives the run a duration the test can bound from below, and keeps the interference
workload's streams decoding while its long prompt prefills, as on a real model."""

from __future__ import annotations

import argparse
import json
import time

import pytest

from chunkserve.bench.serve import add_arguments, format_table, run_benchmark
from chunkserve.entrypoints import cli
from tests.server_process import API_KEY
from tests.tiny_model import STEP_DELAY_MS

TOP_LEVEL_KEYS = {"label", "workload", "config", "base_url", "model", "bench_start", "summary", "interference",
                  "requests"}


@pytest.fixture(scope="module")
def server(tiny_delayed_server):
    """The tiny model's server, each step delayed so that streams outlast the test's actions."""
    return tiny_delayed_server


def bench_args(server, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--base-url", server.base_url, *flags])


def test_random_workload_result_file(server, tmp_path):
    path = tmp_path / "random.json"
    wall_started = time.monotonic()
    returned = run_benchmark(bench_args(server, "--num-prompts", "6", "--input-len", "32", "--output-len", "8",
                                        "--api-key", API_KEY, "--result-file", str(path)))
    wall_s = time.monotonic() - wall_started
    result = json.loads(path.read_text())
    assert result == returned
    assert set(result) == TOP_LEVEL_KEYS
    assert result["label"] == "random" and result["interference"] is None
    assert result["model"] == server.client().get("/v1/models").json()["data"][0]["id"]
    assert "api_key" not in result["config"] and result["config"]["request_rate"] == "inf"
    requests, summary = result["requests"], result["summary"]
    assert len(requests) == 6 and all(r["ok"] and r["error"] is None for r in requests)
    assert all(r["completion_tokens"] == 8 and len(r["token_times"]) == 8 for r in requests)
    assert all(r["prompt_len"] == 32 for r in requests)
    assert summary["tbt_ms"]["count"] == sum(len(r["token_times"]) - 1 for r in requests)
    assert summary["ttft_ms"]["count"] == 6 and summary["ttft_ms"]["p50"] > 0
    assert all(r["send_time"] < r["token_times"][0] <= r["token_times"][-1] <= r["end_time"] for r in requests)
    assert (summary["completed"], summary["failed"]) == (6, 0)
    # duration_s spans the first send to the last end: within the wall time around the run, and at
    # least the 8 delayed steps that every request's 8 tokens needed.
    assert summary["duration_s"] == pytest.approx(max(r["end_time"] for r in requests)
                                                  - min(r["send_time"] for r in requests))
    assert 8 * STEP_DELAY_MS / 1000 <= summary["duration_s"] <= wall_s
    assert summary["completed"] / summary["duration_s"] == pytest.approx(summary["request_throughput"])
    assert summary["output_token_throughput"] == pytest.approx(48 / summary["duration_s"])
    assert summary["goodput"] == pytest.approx(summary["request_throughput"])
    assert "TTFT" in format_table(result)


def test_interference_workload_fills_its_block_and_plots(server, tmp_path):
    result_path = tmp_path / "interference.json"
    result = run_benchmark(bench_args(
        server, "--workload", "interference", "--streams", "2", "--stream-input-len", "16",
        "--stream-output-len", "12", "--long-prompts", "1", "--long-len", "200", "--long-start", "0.2",
        "--long-output-len", "2", "--api-key", API_KEY, "--label", "interference-test",
        "--result-file", str(result_path)))
    assert result["label"] == "interference-test"
    requests, block = result["requests"], result["interference"]
    assert all(r["ok"] for r in requests)
    assert [r["kind"] for r in requests] == ["stream", "stream", "long"]
    long = requests[2]
    assert block["long_send_times"] == [long["send_time"]]
    assert long["send_time"] - result["bench_start"] >= 0.2
    assert block["window"] == [long["send_time"], long["token_times"][0]]
    assert block["long_ttft_ms"]["count"] == 1
    assert block["long_ttft_ms"]["max"] == pytest.approx(1000 * (long["token_times"][0] - long["send_time"]))
    assert block["stream_tbt_ms"]["count"] == 2 * 11
    assert 0 < block["tbt_during_long_ms"]["count"] <= 2 * 11
    assert "TBT during long" in format_table(result)
    assert_plots(server, result_path, tmp_path)


def assert_plots(server, result_path, tmp_path) -> None:
    """`chunkserve bench plot` on the run's result and the server's steps during it: non-empty PNGs."""
    bench_start = json.loads(result_path.read_text())["bench_start"]
    with server.admin_client() as http:
        steps = http.get("/debug/steps", params={"last": 1000}).json()["steps"]
    trace_path = tmp_path / "run.jsonl"
    trace_path.write_text("".join(json.dumps(s) + "\n" for s in steps if s["start_time"] >= bench_start))
    out_dir = tmp_path / "figures"
    cli.main(["bench", "plot", str(result_path), "--trace", str(trace_path), "-o", str(out_dir)])
    pngs = {path.name: path.read_bytes() for path in out_dir.iterdir()}
    assert set(pngs) == {"steps_run.png", "timeline.png", "tbt_cdf.png"}
    assert all(data.startswith(b"\x89PNG") and len(data) > 10_000 for data in pngs.values())


def test_failed_requests_are_recorded_not_raised(server):
    result = run_benchmark(bench_args(server, "--num-prompts", "2", "--input-len", "8", "--output-len", "2",
                                      "--model", "any", "--api-key", "wrong-key"))
    assert all(not r["ok"] and r["error"].startswith("HTTP 401") for r in result["requests"])
    assert (result["summary"]["completed"], result["summary"]["failed"]) == (0, 2)
    assert result["summary"]["ttft_ms"]["count"] == 0 and result["summary"]["goodput"] == 0.0


def test_max_concurrency_one_sends_each_request_after_the_previous_ends(server):
    result = run_benchmark(bench_args(server, "--num-prompts", "3", "--input-len", "8", "--output-len", "2",
                                      "--max-concurrency", "1", "--api-key", API_KEY))
    requests = sorted(result["requests"], key=lambda r: r["send_time"])
    assert all(r["ok"] for r in requests)
    assert all(later["send_time"] >= earlier["end_time"] for earlier, later in zip(requests, requests[1:]))


def test_multi_turn_workload_follows_each_turn_and_hits_the_prefix_cache(server):
    result = run_benchmark(bench_args(server, "--workload", "multi-turn", "--num-prompts", "2", "--turns", "3",
                                      "--prefix-len", "64", "--input-len", "16", "--output-len", "4",
                                      "--seed", "61", "--api-key", API_KEY))
    requests = result["requests"]
    assert all(r["ok"] for r in requests) and [r["prompt_len"] for r in requests] == [80, 100, 120] * 2
    for chat in (requests[:3], requests[3:]):
        assert all(later["send_time"] >= earlier["end_time"] for earlier, later in zip(chat, chat[1:]))
        assert all(r["cached_tokens"] >= 80 - 16 for r in chat[1:]), "a later turn recomputed its history"
    assert result["summary"]["prefix_cache_hit_rate"] > 0.5
    assert "Prefix cache hit rate" in format_table(result)


def test_sharegpt_dataset_sends_the_files_prompts_counted_by_the_servers_tokenizer(server, tmp_path):
    chats = [{"conversations": [{"from": "human", "value": f"Question number {i}: what is {i} plus {i}?"},
                                {"from": "gpt", "value": f"It is {2 * i}, which is {i} twice."}]} for i in range(3)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(chats))
    result = run_benchmark(bench_args(server, "--dataset-name", "sharegpt", "--dataset-path", str(path),
                                      "--num-prompts", "3", "--sharegpt-output-len", "4", "--api-key", API_KEY))
    client = server.client()
    model = client.get("/v1/models").json()["data"][0]["id"]
    expected = sorted(len(client.post("/tokenize", json={"model": model, "prompt": c["conversations"][0]["value"]})
                          .json()["tokens"]) for c in chats)
    assert result["label"] == result["workload"] == "sharegpt"
    assert sorted(r["prompt_len"] for r in result["requests"]) == expected
    assert all(r["ok"] and r["completion_tokens"] == 4 for r in result["requests"])


def test_sharegpt_without_a_file_is_refused_before_anything_is_sent(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--dataset-name", "sharegpt"])
    assert exit_info.value.code == 2
    assert "--dataset-name sharegpt needs --dataset-path" in capsys.readouterr().err

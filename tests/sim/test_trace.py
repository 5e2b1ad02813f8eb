"""The simulator's requests: a trace file's lines, a bench workload, a bench result's workload."""

from __future__ import annotations

import json

import numpy as np
import pytest

from chunkserve.bench.serve import config_of, write_json
from chunkserve.bench.workloads import build_workload
from chunkserve.errors import InvalidRequestError
from chunkserve.sim.trace import (
    SimRequest,
    from_bench_result,
    from_request_log,
    from_workload,
    read_request_trace,
    write_request_trace,
)
from tests.sim.support import workload


def write_lines(path, lines: list[dict]) -> str:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def test_lengths_with_prefixes_and_sessions_share_exactly_what_the_trace_says(tmp_path):
    requests = read_request_trace(write_lines(tmp_path / "t.jsonl", [
        {"arrival": 0.0, "prompt_len": 300, "prefix_id": "sys", "prefix_len": 256, "output_len": 8},
        {"arrival": 0.5, "prompt_len": 280, "prefix_id": "sys", "prefix_len": 256, "output_len": 8, "session_id": "a"},
        {"arrival": 1.0, "prompt_len": 400, "output_len": 16, "session_id": "a", "after": 1},
        {"arrival": 1.5, "prompt_token_ids": [5, 6, 7], "output_len": 2, "n": 3, "priority": -1, "kind": "probe"},
    ]))
    first, second, third, fourth = requests
    assert [len(r.prompt_token_ids) for r in requests] == [300, 280, 400, 3]
    assert first.prompt_token_ids[:256] == second.prompt_token_ids[:256]
    assert first.prompt_token_ids[256:] != second.prompt_token_ids[256:280]
    assert third.prompt_token_ids[:280] == second.prompt_token_ids and third.after == 1 and third.arrival == 1.0
    assert (fourth.n, fourth.priority, fourth.kind) == (3, -1, "probe")
    assert read_request_trace(str(tmp_path / "t.jsonl")) == requests  # the same ids every time


def test_a_trace_written_is_the_trace_read(tmp_path):
    requests = [SimRequest((1, 2, 3), 4, 0.5), SimRequest((1, 2, 3, 4), 2, 1.0, "turn", after=0)]
    write_request_trace(requests, str(tmp_path / "t.jsonl"))
    assert read_request_trace(str(tmp_path / "t.jsonl")) == requests


@pytest.mark.parametrize("line, message", [
    ({"prompt_len": 10}, "line 0: output_len"),
    ({"output_len": 4}, "line 0: prompt_len"),
    ({"prompt_len": 10, "output_len": 4, "arrival": -1}, "line 0: arrival"),
    ({"prompt_len": 10, "output_len": 4, "after": 0}, "line 0: after"),
    ({"prompt_token_ids": [1, -2], "output_len": 4}, "line 0: prompt_token_ids"),
    ({"prompt_len": 10, "output_len": 4, "n": 0}, "line 0: n"),
])
def test_a_bad_line_is_refused_by_number_and_field(tmp_path, line, message):
    with pytest.raises(InvalidRequestError, match=message):
        read_request_trace(write_lines(tmp_path / "t.jsonl", [line]))


@pytest.mark.parametrize("name", ["random", "sharegpt-like", "interference", "prefix", "multi-turn"])
def test_a_bench_workload_is_the_requests_bench_serve_sends(name):
    args = workload(workload=name, request_rate=2.0)
    specs = build_workload(args, np.random.default_rng(args.seed))
    requests = from_workload(args)
    assert [(list(r.prompt_token_ids), r.output_len, r.arrival, r.kind, r.after) for r in requests] == \
        [(s.prompt_token_ids, s.output_len, s.send_at, s.kind, s.after) for s in specs]


def test_a_bench_result_gives_back_the_workload_it_ran(tmp_path):
    args = workload(workload="prefix", request_rate=float("inf"), num_prompts=5, seed=3)
    path = str(tmp_path / "result.json")
    write_json({"config": {**config_of(args), "dataset_name": "random"}, "summary": {}}, path)
    assert from_bench_result(path) == from_workload(args)
    write_json({"config": {**config_of(args), "dataset_name": "sharegpt"}}, path)
    with pytest.raises(InvalidRequestError, match="data set"):
        from_bench_result(path)


def test_a_servers_request_log_is_the_requests_it_received(tmp_path, caplog):
    """Lines written by the server's own --enable-log-requests logger, read back."""
    import logging
    from types import SimpleNamespace

    from chunkserve.entrypoints.server.serving import Serving
    from chunkserve.sampling_params import SamplingParams

    serving = SimpleNamespace(options=SimpleNamespace(max_log_len=None))
    with caplog.at_level(logging.INFO, logger="chunkserve.entrypoints.server.serving"):
        Serving._log_request(serving, "cmpl-1", [[5, 6, 7], [8, 9]], SamplingParams(max_tokens=12, n=2))
        Serving._log_request(serving, "cmpl-2", ["hello there"], SamplingParams(max_tokens=3))
    log = tmp_path / "server.log"
    log.write_text("INFO uvicorn: started\n" + "".join(f"INFO {r.name}: {r.getMessage()}\n" for r in caplog.records))
    requests = from_request_log(str(log), tokenize=lambda text: [len(word) for word in text.split()])
    assert [(r.prompt_token_ids, r.output_len, r.n) for r in requests] == [((5, 6, 7), 12, 2), ((8, 9), 12, 2),
                                                                           ((5, 5), 3, 1)]
    assert requests[0].arrival == 0.0 and 0.0 <= requests[2].arrival < 5.0
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        from_request_log(str(log))

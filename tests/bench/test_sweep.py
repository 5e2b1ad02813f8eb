"""The sweep: its config file, the capacity search, the summary, and one real run."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from chunkserve.bench import sweep
from chunkserve.bench.sweep import ServerConfig, SweepConfig

SHIPPED = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "sweep.yaml")


def test_the_shipped_sweep_has_every_configuration_the_study_needs():
    config = SweepConfig.load(SHIPPED)
    labels = [c.label for c in config.configs]
    assert labels[0] == "chunking off" and "chunked 512 no mixing" in labels
    assert {f"chunked {b}" for b in (128, 256, 512, 1024, 2048)} <= set(labels)
    assert set(config.workloads) == {"interference", "throughput"} and config.capacity["slo_tbt_ms"] > 0


@pytest.mark.parametrize("true_capacity, expected", [(10.0, 4.0), (2.6, 2.25), (1.0, 0.9375), (0.1, 0.0)])
def test_capacity_is_the_highest_passing_rate_found_by_bisection(monkeypatch, true_capacity, expected):
    """A fake server whose P99 TBT exceeds the SLO exactly above `true_capacity` req/s."""
    probed, seeds = [], []

    def fake_bench(base_url, config, flags, label, result_file):
        rate = float(flags[flags.index("--request-rate") + 1])
        probed.append(rate)
        seeds.append(flags[flags.index("--seed") + 1])
        p99 = 100.0 if rate <= true_capacity else 900.0
        return {"summary": {"failed": 0, "tbt_ms": {"p99": p99}, "ttft_ms": {"p50": 300.0}}}

    monkeypatch.setattr(sweep, "_bench", fake_bench)
    spec = {"slo_tbt_ms": 500, "min_rate": 0.5, "max_rate": 4, "probes": 4, "args": []}
    config = SweepConfig(out_dir="", port=0, server_args=[], configs=[], workloads={}, capacity=spec)
    assert sweep._capacity("http://x", ServerConfig("fake"), config) == expected
    assert probed[0] == 4.0 and len(probed) == (1 if true_capacity >= 4 else 4)
    assert len(set(seeds)) == len(seeds)  # fresh prompts for every probe


def test_a_probe_whose_median_ttft_exceeds_the_bound_fails(monkeypatch):
    """Overload shows in the queue, not in TBT: above 1.5 req/s the median TTFT grows past 2 s."""
    def fake_bench(base_url, config, flags, label, result_file):
        rate = float(flags[flags.index("--request-rate") + 1])
        return {"summary": {"failed": 0, "tbt_ms": {"p99": 100.0}, "ttft_ms": {"p50": 500.0 if rate <= 1.5 else 9000.0}}}

    monkeypatch.setattr(sweep, "_bench", fake_bench)
    spec = {"slo_tbt_ms": 500, "max_median_ttft_s": 2, "min_rate": 0.5, "max_rate": 4, "probes": 4, "args": []}
    config = SweepConfig(out_dir="", port=0, server_args=[], configs=[], workloads={}, capacity=spec)
    assert sweep._capacity("http://x", ServerConfig("fake"), config) == 1.375  # 4, 2.25 fail; 1.375 passes; 1.8125 fails
    assert sweep._capacity("http://x", ServerConfig("fake"), SweepConfig(
        out_dir="", port=0, server_args=[], configs=[], workloads={}, capacity={**spec, "max_median_ttft_s": None})) == 4


def test_summary_rows_and_table():
    dist = {"p50": 80.0, "p90": 90.0, "p99": 400.0, "max": 900.0, "mean": 85.0, "count": 10}
    results = {
        "interference": {"interference": {"long_ttft_ms": {**dist, "p50": 3000.0}, "tbt_during_long_ms": dist}},
        "throughput": {"interference": None, "summary": {"ttft_ms": {**dist, "p50": 1200.0},
                                                         "output_token_throughput": 150.0}},
    }
    row = sweep.summary_row("chunked 256", results, capacity=1.5)
    assert row == {"config": "chunked 256", "capacity_rps": 1.5, "long_ttft_p50_s": 3.0, "tbt_p50_ms": 80.0,
                   "tbt_p99_ms": 400.0, "tbt_max_ms": 900.0, "short_ttft_p50_ms": 1200.0, "output_tok_s": 150.0}
    table = sweep.summary_table([row, {"config": "peer", "error": "FileNotFoundError: start.sh"}])
    assert "| chunked 256 | 3.00 | 1200 | 80 | 400 | 900 | 150.0 | 1.50 |" in table
    assert "| peer | - | - | - | - | - | - | - |" in table
    assert table.endswith("Failed configurations:\n- peer: FileNotFoundError: start.sh")


def test_a_real_sweep_of_one_configuration(tmp_path):
    config_file = tmp_path / "sweep.yaml"
    out_dir = tmp_path / "out"
    config_file.write_text(json.dumps({  # JSON is YAML
        "out_dir": str(out_dir), "port": sweep_port(), "server_args": ["--kv-cache-memory-gb", "0.1"],
        "configs": [{"label": "chunked 64", "args": ["--max-num-batched-tokens", "64"]},
                    {"label": "not installed", "command": [str(tmp_path / "no-such-server.sh"), "{port}"]}],
        "workloads": {"throughput": ["--workload", "random", "--num-prompts", "4", "--input-len", "40",
                                     "--output-len", "6"]},
    }))
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    sweep.main(parser.parse_args(["--config", str(config_file)]))
    row, missing = json.loads((out_dir / "summary.json").read_text())
    assert missing["config"] == "not installed" and "no-such-server.sh" in missing["error"]
    assert row["config"] == "chunked 64" and row["output_tok_s"] > 0 and row["capacity_rps"] is None
    result = json.loads((out_dir / "chunked-64.throughput.json").read_text())
    assert result["summary"]["completed"] == 4
    steps = [json.loads(line) for line in (out_dir / "chunked-64.steps.jsonl").read_text().splitlines()]
    assert sum(s["num_decode_tokens"] for s in steps) == 4 * 5  # the trace saw every decode step
    assert "server stopped" in (out_dir / "chunked-64.server.log").read_text()  # stopped by SIGTERM, cleanly


def sweep_port() -> int:
    from tests.server_process import free_port

    return free_port()

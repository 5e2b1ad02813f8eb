"""The sweep: its config file, the capacity search, the summary, and one real run."""

from __future__ import annotations

import argparse
import glob
import json
import os

import pytest

from chunkserve.bench import serve as bench_serve
from chunkserve.bench import sweep
from chunkserve.bench.sweep import ServerConfig, SweepConfig
from chunkserve.config import EngineArgs
from chunkserve.entrypoints.args import from_cli_args
from chunkserve.entrypoints.cli import build_parser

BENCHMARKS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
SHIPPED = os.path.join(BENCHMARKS, "peers", "sweep.yaml")


def test_the_shipped_sweep_has_every_configuration_the_study_needs():
    config = SweepConfig.load(SHIPPED)
    labels = [c.label for c in config.configs]
    assert labels[0] == "chunking off" and "chunked 512 no mixing" in labels
    assert {f"chunked {b}" for b in (128, 256, 512, 1024, 2048)} <= set(labels)
    assert set(config.workloads) == {"interference", "throughput"} and config.capacity["slo_tbt_ms"] > 0


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(BENCHMARKS, "*", "*.yaml"))), ids=os.path.basename)
def test_every_shipped_sweep_config_parses(path):
    """A typo in a flag would otherwise surface only when its server starts, deep in a long sweep."""
    config = SweepConfig.load(path)
    cli = build_parser()
    for server in config.configs:
        if server.command is None:
            from_cli_args(EngineArgs, cli.parse_args(["serve", *config.server_args, *server.args]))
    bench = argparse.ArgumentParser()
    bench_serve.add_arguments(bench)
    flag_sets = list(config.workloads.values()) + ([config.capacity["args"]] if config.capacity else [])
    for flags in flag_sets:
        bench.parse_args(["--base-url", "http://127.0.0.1:1", *flags])


def test_each_workload_draws_its_own_prompts_unless_it_names_a_seed():
    flags = sweep.workload_flags({"a": ["--workload", "random"], "b": ["--workload", "random"],
                                  "c": ["--seed", "7"]})
    assert flags == {"a": ["--workload", "random", "--seed", "0"], "b": ["--workload", "random", "--seed", "1"],
                     "c": ["--seed", "7"]}


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


def write_result(path, summary: dict, interference: dict | None = None, rate: float | str = "inf") -> None:
    path.write_text(json.dumps({"summary": summary, "interference": interference, "config": {"request_rate": rate}}))


def summary(dist: dict, output_tok_s: float, **extra) -> dict:
    """A result summary with every latency distribution set to ``dist``."""
    return {"ttft_ms": dist, "tbt_ms": dist, "e2e_ms": dist, "output_token_throughput": output_tok_s,
            "total_token_throughput": 4 * output_tok_s, **extra}


def test_summary_rows_and_tables_from_the_result_files(tmp_path):
    dist = {"p50": 80.0, "p90": 90.0, "p99": 400.0, "max": 900.0, "mean": 85.0, "count": 10}
    spec = {"slo_tbt_ms": 500, "max_median_ttft_s": 2, "min_rate": 0.5, "max_rate": 2, "args": []}
    config = SweepConfig(out_dir=str(tmp_path), port=0, server_args=[],
                         configs=[ServerConfig("chunked 256"), ServerConfig("slow"), ServerConfig("peer")],
                         workloads={"interference": [], "throughput": []}, capacity=spec)
    write_result(tmp_path / "chunked-256.interference.json", summary(dist, 20.0),
                 {"long_ttft_ms": {**dist, "p50": 3000.0}, "tbt_during_long_ms": dist})
    write_result(tmp_path / "chunked-256.throughput.json",
                 {**summary(dist, 150.0, prefix_cache_hit_rate=0.25), "ttft_ms": {**dist, "p50": 1200.0}})
    for rate, p99 in ((2.0, 900.0), (1.25, 450.0), (0.875, 300.0)):
        write_result(tmp_path / f"chunked-256.capacity-{rate:.3f}.json",
                     {"failed": 0, "tbt_ms": {"p99": p99}, "ttft_ms": {"p50": 1500.0}}, rate=rate)
    write_result(tmp_path / "slow.throughput.json", summary(dist, 10.0))
    write_result(tmp_path / "slow.capacity-0.500.json",
                 {"failed": 0, "tbt_ms": {"p99": 100.0}, "ttft_ms": {"p50": 9000.0}}, rate=0.5)
    rows = [sweep.summary_row(config, c, "FileNotFoundError: start.sh" if c.label == "peer" else None)
            for c in config.configs]
    assert {k: v for k, v in rows[0].items() if k not in ("capacity_probes", "workloads")} == {
        "config": "chunked 256", "capacity_rps": 1.25, "long_ttft_p50_s": 3.0, "tbt_p50_ms": 80.0,
        "tbt_p99_ms": 400.0, "tbt_max_ms": 900.0, "short_ttft_p50_ms": 1200.0, "output_tok_s": 150.0}
    assert [p["passed"] for p in rows[0]["capacity_probes"]] == [True, True, False]  # sorted by rate
    table = sweep.summary_table(rows)
    assert "| chunked 256 | 3.00 | 1200 | 80 | 400 | 900 | 150.0 | 1.25 |" in table
    assert "| slow | - | 80 | - | - | - | 10.0 | < 0.50 |" in table  # its only probe failed the TTFT bound
    assert "| peer | - | - | - | - | - | - | - |" in table
    assert table.endswith("Failed configurations:\n- peer: FileNotFoundError: start.sh")
    workloads = sweep.workload_table(rows).splitlines()
    assert workloads[2:] == [
        "| interference | chunked 256 | 80 | 400 | 80 | 400 | 0.08 | 20.0 | 80 | - |",
        "| throughput | chunked 256 | 1200 | 400 | 80 | 400 | 0.08 | 150.0 | 600 | 25.0 |",
        "| throughput | slow | 80 | 400 | 80 | 400 | 0.08 | 10.0 | 40 | - |",
    ]
    probes = sweep.capacity_table(rows, spec)
    assert "| chunked 256 |  | **300 / 1.5** | **450 / 1.5** | 900 / 1.5 |" in probes
    assert "| slow | 100 / 9.0 |  |  |  |" in probes


@pytest.mark.slow
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
    assert row["config"] == "chunked 64" and row["output_tok_s"] > 0 and "capacity_rps" not in row
    result = json.loads((out_dir / "chunked-64.throughput.json").read_text())
    assert result["summary"]["completed"] == 4
    steps = [json.loads(line) for line in (out_dir / "chunked-64.steps.jsonl").read_text().splitlines()]
    assert sum(s["num_decode_tokens"] for s in steps) == 4 * 5  # the trace saw every decode step
    assert "server stopped" in (out_dir / "chunked-64.server.log").read_text()  # stopped by SIGTERM, cleanly
    machine = json.loads((out_dir / "machine.json").read_text())  # the CPU every number of the run is from
    assert machine["cpu"] and machine["cpus"] == str(os.cpu_count()) and machine["date"]
    first_table = (out_dir / "summary.md").read_text()
    sweep.main(parser.parse_args(["--config", str(config_file), "--summarize-only"]))  # nothing runs
    table = (out_dir / "summary.md").read_text()
    assert table.splitlines()[2] == first_table.splitlines()[2]  # the chunked 64 row, from its files
    assert "- not installed: no result files in" in table


def sweep_port() -> int:
    from tests.server_process import free_port

    return free_port()

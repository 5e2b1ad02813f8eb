"""`chunkserve bench plot --figure KIND` on small compact result files, the committed ones in
docs/data, and the compact file `chunkserve bench sweep` writes."""

from __future__ import annotations

import argparse
import json
import pathlib
import re

import pytest

from chunkserve.bench import figure_data
from chunkserve.bench.plot import add_arguments, main
from chunkserve.bench.summary_figures import FIGURES

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
DOCS_DATA = DOCS / "data"
# The commands docs/BENCHMARKS.md gives for its figures: --figure KIND docs/data/X.json -o docs/img/Y.png
DOC_FIGURES = re.findall(r"bench plot --figure (\w+) (docs/data/\S+\.json) -o docs/img/(\S+\.png)",
                         (DOCS / "BENCHMARKS.md").read_text())
SOURCE = {"command": "chunkserve bench sweep --config x.yaml", "commit": "abc1234", "cpu": "Test CPU, 2 cores",
          "date": "2026-11-28", "log_section": "A test section"}


def _ranged(value: float) -> dict:
    return {"median": value, "low": value * 0.9, "high": value * 1.1}


def _peer_configs() -> list[dict]:
    return [{"label": label, "dtype": dtype, "args": args,
             "values": {"scenario-a.output_tok_s": _ranged(400 * scale), "decode-1.tbt_p50_ms": _ranged(5 / scale),
                        "decode-8.tbt_p50_ms": _ranged(12 / scale), "tbt_p99_ms": 300 / scale ** 3,
                        "long_ttft_p50_s": 1.2 / scale, "capacity_rps_slo_250ms": 0.5 * scale,
                        "capacity_rps_slo_500ms": 1.0 * scale}}
            for label, dtype, args, scale in (("budget 64", "float32", ["--max-num-batched-tokens", "64"], 1.0),
                                              ("budget 256", "float32", ["--max-num-batched-tokens", "256"], 1.5),
                                              ("slo 250", "bfloat16", ["--tbt-slo-ms", "250"], 0.8),
                                              ("peer Q4_0", "Q4_0 GGUF", [], 0.5))]


def _speculative_configs() -> list[dict]:
    return [{"label": f"{workload}, {streams}, {mode}", "workload": workload, "streams": streams, "mode": mode,
             "dtype": "float32", "values": {"out_tok_s": 20.0 * streams * ratio, "vs_own_off": ratio}}
            for workload in ("chat", "high-overlap") for streams in (1, 8)
            for mode, ratio in (("off", 1.0), ("auto", 1.4), ("vllm-ngram", 0.7))]


def _disaggregation_configs() -> list[dict]:
    return [{"label": "colocated", "dtype": "float32",
             "values": {"tbt_p50_ms": 1200, "tbt_p99_ms": 1600, "tbt_max_ms": 1650, "long_ttft_p50_s": 19.1,
                        "long_ttft_p99_s": 25.9, "output_tok_s": 52.5}},
            {"label": "disaggregated", "dtype": "float32",
             "values": {"tbt_p50_ms": 160, "tbt_p99_ms": 210, "tbt_max_ms": 300, "output_tok_s": 44.3}}]


def _data(kind: str) -> dict:
    configs = {"speculative": _speculative_configs, "disaggregation": _disaggregation_configs}.get(kind, _peer_configs)()
    return {"title": f"test {kind}", "source": dict(SOURCE), "reference": configs[0]["label"], "configs": configs}


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def _write(path: pathlib.Path, data: dict) -> str:
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("kind", sorted(FIGURES))
def test_each_figure_kind_writes_a_png(tmp_path, kind):
    data_path = _write(tmp_path / f"{kind}.json", _data(kind))
    out = tmp_path / "figs" / f"{kind}.png"
    main(_parse(["--figure", kind, data_path, "-o", str(out)]))
    assert out.read_bytes()[:8] == PNG_SIGNATURE


def test_the_peers_figure_prints_its_table_with_the_ratios(tmp_path, capsys):
    main(_parse(["--figure", "peers", _write(tmp_path / "p.json", _data("peers")), "-o", str(tmp_path / "p.png")]))
    table = capsys.readouterr().out
    assert "| budget 256 | 600 (540-660), 1.50x |" in table  # the median (range) and its ratio to budget 64


@pytest.mark.parametrize(("kind", "missing"), [("throughput", "scenario-a.output_tok_s"), ("tradeoff", "tbt_p99_ms"),
                                               ("speculative", "vs_own_off"), ("disaggregation", "tbt_p99_ms")])
def test_a_file_without_a_metric_names_the_file_the_config_and_the_metric(tmp_path, capsys, kind, missing):
    data = _data(kind)
    del data["configs"][1]["values"][missing]
    path = _write(tmp_path / "bad.json", data)
    with pytest.raises(SystemExit) as exit_info:
        main(_parse(["--figure", kind, path, "-o", str(tmp_path / "bad.png")]))
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert path in error and "configs[1]" in error and missing in error
    assert not (tmp_path / "bad.png").exists()


def test_a_file_without_its_provenance_or_capacity_is_a_clear_error(tmp_path, capsys):
    data = _data("capacity")
    del data["source"]["log_section"]
    with pytest.raises(SystemExit):
        main(_parse(["--figure", "capacity", _write(tmp_path / "a.json", data), "-o", str(tmp_path / "a.png")]))
    assert "source: missing required key(s): log_section" in capsys.readouterr().err
    data = _data("capacity")
    for config in data["configs"]:
        config["values"] = {k: v for k, v in config["values"].items() if not k.startswith("capacity")}
    with pytest.raises(SystemExit):
        main(_parse(["--figure", "capacity", _write(tmp_path / "b.json", data), "-o", str(tmp_path / "b.png")]))
    assert "no configuration has a capacity value" in capsys.readouterr().err


def test_figure_takes_one_data_file_and_a_png_path(tmp_path, capsys):
    path = _write(tmp_path / "d.json", _data("decode"))
    with pytest.raises(SystemExit):
        main(_parse(["--figure", "decode", path, "-o", str(tmp_path / "figs")]))
    assert "FILE.png" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(_parse(["--figure", "decode", path, path, "-o", str(tmp_path / "d.png")]))
    assert "one compact result file, got 2" in capsys.readouterr().err


def test_the_committed_data_files_are_valid_and_name_their_source():
    paths = sorted(DOCS_DATA.glob("*.json"))
    assert paths
    for path in paths:
        data = figure_data.load(str(path))
        assert all(data["source"][key] for key in figure_data.SOURCE_KEYS), path


@pytest.mark.parametrize(("kind", "data_path", "png"), DOC_FIGURES)
def test_each_documented_figure_is_embedded_and_redraws_from_its_data(tmp_path, kind, data_path, png):
    assert f"](img/{png})" in (DOCS / "BENCHMARKS.md").read_text()
    assert (DOCS / "img" / png).read_bytes()[:8] == PNG_SIGNATURE
    main(_parse(["--figure", kind, str(DOCS.parent / data_path), "-o", str(tmp_path / png)]))
    assert (tmp_path / png).read_bytes()[:8] == PNG_SIGNATURE


def test_benchmarks_md_documents_at_least_five_figures():
    assert len(DOC_FIGURES) >= 5


def _summary_row(label: str, tok_s: float, p99: float | None, capacity: float | None) -> dict:
    row = {"config": label, "workloads": {"scenario-a": {"output_tok_s": tok_s, "prefix_hit_pct": None}}}
    if p99 is not None:
        row.update(tbt_p99_ms=p99, long_ttft_p50_s=1.5)
    if capacity is not None:
        row["capacity_rps"] = capacity
    return row


def test_a_sweep_combines_its_rounds_into_the_compact_format(tmp_path):
    rows = [_summary_row("ours (1)", 400.0, 300.0, 0.5), _summary_row("peer (1)", 430.0, None, None),
            _summary_row("ours (2)", 420.0, 280.0, 1.0), _summary_row("peer (2)", 410.0, None, None),
            {"config": "broken", "workloads": {}, "error": "RuntimeError: no server"}]
    (tmp_path / "machine.json").write_text(json.dumps({"cpu": "Test CPU", "cpu_family": "26", "cpu_model": "2",
                                                       "cpus": "2", "avx512_flags": "avx512f", "commit": "abc1234",
                                                       "date": "2026-11-28 07:08 UTC"}))
    commands = {"ours (1)": ["--dtype", "bfloat16"], "peer (1)": ["start_peer.sh", "{port}"]}
    path = figure_data.write_sweep_data(str(tmp_path), rows, commands, "benchmarks/x.yaml", 250.0)
    data = figure_data.load(path)
    assert data["source"]["commit"] == "abc1234" and "Test CPU (family 26 model 2)" in data["source"]["cpu"]
    assert data["source"]["command"] == "chunkserve bench sweep --config benchmarks/x.yaml"
    ours, peer = data["configs"]  # "broken" has no number
    assert (ours["label"], ours["dtype"], peer["dtype"]) == ("ours", "bfloat16", "default dtype")
    assert ours["values"]["scenario-a.output_tok_s"] == {"median": 410.0, "low": 400.0, "high": 420.0,
                                                         "rounds": [400.0, 420.0]}
    assert ours["values"]["capacity_rps_slo_250ms"]["rounds"] == [0.5, 1.0]
    assert "tbt_p99_ms" not in peer["values"] and "scenario-a.prefix_hit_pct" not in ours["values"]
    out = tmp_path / "fig.png"
    main(_parse(["--figure", "throughput", path, "-o", str(out)]))
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    # --summarize-only --slo-tbt-ms 500 re-judges the same run's probes: both SLOs' capacities stay
    rows[0]["capacity_rps"] = 2.0
    figure_data.write_sweep_data(str(tmp_path), rows, commands, "benchmarks/x.yaml", 500.0)
    ours = figure_data.load(path)["configs"][0]["values"]
    assert ours["capacity_rps_slo_500ms"]["rounds"] == [2.0, 1.0] and ours["capacity_rps_slo_250ms"]["median"] == 0.75
    # a new run (another machine.json date) keeps nothing of the earlier one
    (tmp_path / "machine.json").write_text(json.dumps({"commit": "def5678", "date": "2026-11-29 08:00 UTC"}))
    figure_data.write_sweep_data(str(tmp_path), rows, commands, "benchmarks/x.yaml", 500.0)
    assert "capacity_rps_slo_250ms" not in figure_data.load(path)["configs"][0]["values"]

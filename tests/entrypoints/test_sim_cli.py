"""`chunkserve profile` and `chunkserve sim` as a user runs them (in this process)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import yaml

from chunkserve.core.step_predictor import StepShape
from chunkserve.entrypoints.cli import main
from chunkserve.sim.profile import StepTimeProfile
from tests.sim.support import PROFILE
from tests.sim.test_profile import records_from


@pytest.fixture
def profile_file(tmp_path, capsys) -> str:
    trace = tmp_path / "steps.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in records_from(PROFILE, np.ones(200), 0.001)))
    path = str(tmp_path / "profile.json")
    main(["profile", str(trace), "-o", path, "--kv-cache-memory-gb", "1", "--measure-link"])
    out = capsys.readouterr().out
    assert f"profile of 200 steps written to {path}" in out and "KV link (loopback): " in out
    link = StepTimeProfile.load(path).link()
    assert link.bytes_per_s > 1e6 and link.latency_s > 0 and link.send_s_per_block > 0 and link.receive_s_per_block > 0
    return path


def test_a_simulated_run_writes_a_bench_result_that_bench_plot_reads(profile_file, tmp_path, capsys):
    result, steps = str(tmp_path / "result.json"), str(tmp_path / "sim-steps.jsonl")
    main(["sim", "--profile", profile_file, "--workload", "sharegpt-like", "--num-prompts", "12", "--request-rate", "4",
          "--max-num-batched-tokens", "256", "--kv-cache-memory-gb", "1", "--result-file", result,
          "--trace-steps", steps, "--disable-tqdm"])
    out = capsys.readouterr().out
    assert "TTFT" in out and "simulated" in out
    written = json.load(open(result))
    assert written["summary"]["completed"] == 12 and written["simulator"]["profile"]["source"].endswith("steps.jsonl")
    assert written["config"]["engine"]["max_num_batched_tokens"] == 256
    assert all(json.loads(line)["num_prefill_tokens"] + json.loads(line)["num_decode_tokens"] <= 256
               for line in open(steps))
    main(["bench", "plot", result, "--trace", steps, "-o", str(tmp_path / "plots")])
    assert os.listdir(tmp_path / "plots")


def test_a_bench_result_of_the_traced_run_gives_the_profile_its_request_latency(tmp_path, capsys):
    """A run served with 50 ms of request latency and 10 ms of output latency (a simulated one,
    so the truth is known): the profile fitted on its steps and its bench result puts their sum,
    the TTFT the steps do not show, in request_latency_s."""
    trace = tmp_path / "steps.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in records_from(PROFILE, np.ones(200), 0.001)))
    truth = str(tmp_path / "truth.json")
    main(["profile", str(trace), "-o", truth, "--kv-cache-memory-gb", "1"])
    served = json.load(open(truth)) | {"request_latency_s": 0.05, "output_latency_s": 0.01}
    with open(truth, "w") as f:
        json.dump(served, f)
    result, steps, fitted = (str(tmp_path / name) for name in ("result.json", "run-steps.jsonl", "fitted.json"))
    main(["sim", "--profile", truth, "--workload", "sharegpt-like", "--num-prompts", "30", "--request-rate", "2",
          "--kv-cache-memory-gb", "1", "--result-file", result, "--trace-steps", steps, "--disable-tqdm"])
    main(["profile", steps, "-o", fitted, "--kv-cache-memory-gb", "1", "--bench-result", result])
    assert "request latency 60.0 ms" in capsys.readouterr().out
    assert StepTimeProfile.load(fitted).request_latency_s == pytest.approx(0.06, abs=1e-3)


def test_a_bench_results_workload_is_simulated_under_its_name(profile_file, tmp_path):
    """--from-result of an interference run: the simulated result is an interference result too
    (its summary of the streams during the long prompts included), as the real one was."""
    first, again = str(tmp_path / "first.json"), str(tmp_path / "again.json")
    flags = ["--profile", profile_file, "--kv-cache-memory-gb", "1", "--disable-tqdm"]
    main(["sim", *flags, "--workload", "interference", "--streams", "2", "--long-prompts", "1", "--long-len", "512",
          "--stream-output-len", "128", "--long-start", "0.2", "--result-file", first])
    main(["sim", *flags, "--from-result", first, "--result-file", again])
    rebuilt = json.load(open(again))
    assert rebuilt["workload"] == "interference" and rebuilt["interference"]["tbt_during_long_ms"]["count"] > 0
    assert rebuilt["summary"] == json.load(open(first))["summary"]


def test_the_rate_search_prints_the_highest_rate_meeting_the_slos(profile_file, tmp_path, capsys):
    out_file = str(tmp_path / "capacity.json")
    main(["sim", "--profile", profile_file, "--workload", "random", "--num-prompts", "40", "--input-len", "128",
          "--output-len", "16", "--kv-cache-memory-gb", "1", "--search-rate", "--slo", "tbt_p99=100",
          "--slo", "ttft_p50=1000", "--min-rate", "0.5", "--max-rate", "40", "--result-file", out_file])
    assert "highest rate meeting tbt_p99<=100ms, ttft_p50<=1000ms:" in capsys.readouterr().out
    written = json.load(open(out_file))
    assert 0.5 <= written["capacity_rps"] < 40 and written["probes"][0]["passed"] is False


def test_a_sweep_file_is_simulated_and_ranked(profile_file, tmp_path, capsys):
    config = tmp_path / "sweep.yaml"
    config.write_text(yaml.safe_dump({
        "out_dir": str(tmp_path / "real"), "server_args": ["--kv-cache-memory-gb", "1"],
        "configs": [{"label": "budget 64", "args": ["--max-num-batched-tokens", "64"]},
                    {"label": "budget 1024", "args": ["--max-num-batched-tokens", "1024"]},
                    {"label": "pd 1:1", "args": ["--pd", "1:1", "--max-num-batched-tokens", "256"]},
                    {"label": "a peer", "command": ["vllm", "serve"]}],
        "workloads": {"chat": ["--workload", "sharegpt-like", "--num-prompts", "8", "--request-rate", "2"]},
        "capacity": {"slo_tbt_ms": 200, "min_rate": 0.5, "max_rate": 8, "probes": 3,
                     "args": ["--workload", "sharegpt-like", "--num-prompts", "8"]}}))
    main(["sim", "--sweep", str(config), "--profile", profile_file])
    out = capsys.readouterr().out
    assert "Ranking (req/s capacity): budget" in out and "a peer" not in out.split("Ranking")[1]
    summary = open(tmp_path / "real-sim" / "summary.md").read()
    assert "| budget 64 |" in summary and "| budget 1024 |" in summary and "| pd 1:1 |" in summary
    pd_result = json.load(open(tmp_path / "real-sim" / "pd-1-1.chat.json"))
    assert pd_result["simulator"]["pd"] == [1, 1] and pd_result["simulator"]["kv_link_bytes"] > 0


@pytest.mark.parametrize("argv, message", [
    (["sim", "--workload", "random"], "needs --profile"),
    (["sim", "--profile", "{profile}", "--search-rate"], "needs at least one --slo"),
    (["sim", "--profile", "{profile}", "--search-rate", "--workload", "interference", "--slo", "tbt_p99=1"],
     "Poisson"),
    (["sim", "--profile", "{profile}", "--disaggregation-mode", "prefill"], "--disaggregation-mode"),
    (["sim", "--profile", "{profile}", "--trace", "{missing}"], "could not be read"),
    (["sim", "--profile", "{profile}", "--pd", "2"], "--pd must be P:D"),
    (["sim", "--profile", "{profile}", "--pd", "1:1", "--replicas", "2"], "not both"),
])
def test_a_bad_command_line_exits_2_naming_the_problem(profile_file, tmp_path, capsys, argv, message):
    filled = [a.format(profile=profile_file, missing=str(tmp_path / "none.jsonl")) for a in argv]
    with pytest.raises(SystemExit) as exited:
        main(filled)
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_a_profile_of_synthetic_steps_on_this_machine(tiny_gguf, tmp_path, capsys):
    """No trace: the engine times a grid of prompt chunks, decode batches and mixes here."""
    path = str(tmp_path / "here.json")
    main(["profile", "-o", path, "--model", tiny_gguf, "--dtype", "float32", "--repeats", "1",
          "--max-num-batched-tokens", "256", "--max-num-seqs", "16", "--kv-cache-memory-gb", "0.25"])
    assert "written to" in capsys.readouterr().out
    written = json.load(open(path))
    profile = StepTimeProfile.load(path)
    # (single coefficients depend on the host's noise: what the profile predicts does not vanish)
    assert profile.predict(StepShape.of_rows([(0, 64)])) > 0 and profile.predict(StepShape.of_rows([(100, 1)])) > 0
    assert written["step_gap_s"] == 0.0 and written["kv_link"] is None
    assert written["provenance"]["source"].startswith("synthetic steps") and written["provenance"]["dtype"] == "float32"

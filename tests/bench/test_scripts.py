"""Every script in benchmarks/ runs: its `--help`, and its smoke run as a user runs it
(`python -m benchmarks.KIND.NAME ...` from the repository, a subprocess of its own) on the tiny model or the smallest
shapes, or, for the studies that need peers or minutes of serving, its dry run (the plan and
the servers' commands, every flag parsed, nothing started). A script that imports a name that
is gone, reaches for an attribute that was renamed or passes a flag that no longer exists fails
here, not in the middle of someone's measurement.

The smoke runs go two at a time (this is a 2-core budget: a run is mostly one interpreter's
start-up), all launched by the first test that needs one; each test waits for its own script's.
Numbers from a smoke run mean nothing: a test checks that the script finished and printed its
report."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from chunkserve.core.messages import ForwardMode
from chunkserve.engine.outputs import StepRecord
from tests.server_process import ADMIN_API_KEY, API_KEY

BENCHMARKS = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
REPOSITORY = os.path.dirname(BENCHMARKS)
# benchmarks/kernels: kernel micro-benchmarks; benchmarks/engine: engine studies; benchmarks/fleet: routers before
# replicas; benchmarks/peers: the peers' set-up and conformance against them (beside their launch scripts)
KINDS = ("kernels", "engine", "fleet", "peers")
SMOKE_TIMEOUT_S = 180
PARALLEL_RUNS = 2

# script -> (its smoke run's arguments, a line its output must contain). Placeholders: {tiny} the tiny
# model's Hugging Face folder, {tiny_gguf} its GGUF file, {tmp} a folder of the run's, {url} the tiny
# model's server, {trace} a step trace and {sweep} a sweep's out_dir (summary.json, machine.json)
# written by `inputs`.
SMOKE: dict[str, tuple[list[str], str]] = {
    # kernel micro-benchmarks: the smallest shapes
    "decode_attention": (["--smoke", "--deterministic"], "| deterministic |"),
    "prefill_attention": (["--smoke", "--deterministic"], "| 16 @ 32 |"),
    "small_batch_linear": (["--smoke"], "C++ kernels:"),
    "gemm_dtypes": (["--smoke"], "| gate_up 4 rows |"),
    # engine studies: the tiny model
    "decode_step": (["--smoke", "--model", "{tiny}"], "1 x ctx 16"),
    "mixed_context_decode": (["--smoke", "--model", "{tiny}"], "decode step, 8 short + 1 long context"),
    "dtype_speed": (["--smoke", "--model", "{tiny}"], "decode-8 step (ms)"),
    "step_time_curve": (["--smoke", "--model", "{tiny}", "--plot", "{tmp}/curve.png"], "plot: "),
    "onednn_steps": (["--smoke", "--model", "{tiny}"], "| a 16-token chunk |"),
    "gil_contention": (["--smoke", "--model", "{tiny}"], "| ratio to alone |"),
    "engine_overhead": (["--smoke", "--model", "{tiny}"], "engine overhead (all but the worker)"),
    "op_time": (["--smoke", "--model", "{tiny}"], "this run took"),
    "engine_speed": (["--smoke", "--model", "{tiny}"], "long-prompt interference"),
    "step_message_bytes": (["--smoke", "--model", "{tiny}"], "| core -> workers |"),
    "trace_overhead": (["--smoke"], "trace cost per step"),
    "kv_events_overhead": (["--smoke", "--model", "{tiny}"], "publish cost per step"),
    "parallel": (["--smoke", "--model", "{tiny}"], "gloo on this host"),
    "grammar_backends": (["--smoke", "--model", "{tiny}"], "| json small | llguidance |"),
    "multimodal": (["--smoke", "--model-dir", "{tmp}/model", "--json", "{tmp}/multimodal.json"],
                   "| (d) text arrivals (baseline) |"),
    # server studies: the ones that need peers or minutes of serving run dry; engine_death runs
    # for real on the tiny model (one server, seconds), determinism too (its deterministic server, a few requests),
    # hostile against the tiny model's server
    "spec_decode": (["--dry-run", "--model", "{tiny}", "--streams", "1", "--requests-per-stream", "1",
                     "--min-requests", "1", "--check-outputs", "0"], "round 1: auto"),
    "structured_outputs": (["--dry-run", "--sampler-iterations", "2"], "round 2: chunkserve"),
    "hicache": (["--dry-run"], "workload preemption"),
    "pd_interference": (["--dry-run"], "(c) streams only"),
    "sim_pd_accuracy": (["--smoke"], "flags parsed"),
    "dashboard": (["--dry-run", "--cost", "--screenshot", "{tmp}/dashboard.png"], "cost: 3 rounds"),
    "shared_host": (["--variant", f"after {REPOSITORY}", "--dry-run"], "after: in "),
    "engine_death": (["--repeat", "1", "--", "--model", "{tiny}"], "exit_code"),
    "determinism": (["--smoke", "--model", "{tiny}"], "| deterministic | temperature 0.8, seed |"),
    "hostile": (["--url", "{url}", "--api-key", API_KEY, "--admin-api-key", ADMIN_API_KEY, "--cases",
                 "bearer_case,admin_endpoints", "--bystanders", "1", "--bystander-tokens", "4",
                 "--drain-timeout", "20"], "2/2 cases passed"),
    # fleet studies: minutes of serving behind routers, so the plan only; the event router is a server
    "multi_turn": (["--dry-run"], "16 chats x 6 turns"),
    "event_router": (["--help"], "--overlap-weight"),
    "pd_routers": (["--dry-run"], "decode (core 1):"),
    # peers: the conversion they load, and chunkserve's half of the KV events conformance (no vLLM here)
    "gguf_to_hf": (["--gguf", "{tiny_gguf}", "--out", "{tmp}/hf"], "architectures=['LlamaForCausalLM']"),
    "kv_events_conformance": (["--smoke", "--model", "{tiny}"], "conformance: ok"),
    # trace and sweep analyses: small files in the formats they read
    "margin_replay": (["{trace}"], "| p99 x level of last 4 (default) |"),
    "sim_accuracy": (["--smoke", "--out", "{tmp}/sim"], "### Profile: smoke (the same profile twice)"),
    "predictor_accuracy": (["{trace}"], "decode only"),
    "tradeoff_plot": (["{sweep}/summary.json", "-o", "{tmp}/tradeoff.png", "--slo-ms", "100"], "plot: "),
}
KIND_OF = {name.removesuffix(".py"): kind for kind in KINDS for name in os.listdir(os.path.join(BENCHMARKS, kind))
           if name.endswith(".py") and name != "__init__.py"}
SCRIPTS = sorted(KIND_OF)


def module_of(script: str) -> str:
    return f"benchmarks.{KIND_OF[script]}.{script}"


def path_of(script: str) -> str:
    return os.path.join(BENCHMARKS, KIND_OF[script], f"{script}.py")


def test_scripts_live_in_their_kinds_only():
    """benchmarks/ itself holds what the scripts share (support.py) and the folders of kinds."""
    assert sorted(name for name in os.listdir(BENCHMARKS) if name.endswith(".py")) == ["__init__.py", "support.py"]


def test_every_script_has_a_smoke_run():
    assert set(SCRIPTS) == set(SMOKE)


def test_no_script_imports_another():
    """Shared helpers live in benchmarks/support.py (or the package); a script is no library."""
    for name in SCRIPTS:
        with open(path_of(name)) as f:
            imports = [line for line in f if line.startswith(("from ", "import "))]
        assert not [line for line in imports if line.split()[1].split(".")[-1] in SCRIPTS], name
        assert not [line for line in imports if " import _" in line], name


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script, monkeypatch, capsys):
    """`--help` in this process (as `python -m` runs it, the repository first on the path)."""
    monkeypatch.syspath_prepend(REPOSITORY)
    monkeypatch.setattr(sys, "argv", [path_of(script), "--help"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module(module_of(script), run_name="__main__", alter_sys=True)
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")


# smoke runs of scripts whose subject a test of its own checks in the default tier (the GGUF loader, KV events,
# the parallel engine, the engine's death, images, the live dashboard): the long tier runs them, for the default
# tier's 15 minutes (CI runs both on every change)
LONG_TIER_SMOKE = {"gguf_to_hf", "kv_events_conformance", "parallel", "engine_death", "multimodal", "dashboard"}


@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.slow) if s in LONG_TIER_SMOKE else s
                                    for s in SCRIPTS])
def test_smoke_run(script, smoke_runs):
    done = smoke_runs[script].result()
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{done.args}\n{output[-4000:]}"
    assert SMOKE[script][1] in done.stdout, f"{done.args}\n{output[-4000:]}"


@pytest.fixture(scope="session")
def smoke_runs(request, tmp_path_factory) -> dict[str, Future]:
    """Every selected script's smoke run, started now, PARALLEL_RUNS at a time."""
    selected = [item.callspec.params["script"] for item in request.session.items
                if item.originalname == "test_smoke_run" and item.module.__name__ == __name__]
    values = inputs(request, tmp_path_factory, [part for script in selected for part in SMOKE[script][0]])
    env = {**os.environ, "OMP_NUM_THREADS": "1",  # tiny shapes: more threads only spin against the other run
           "PYTHONPATH": os.pathsep.join(filter(None, [REPOSITORY, os.environ.get("PYTHONPATH")]))}
    pool = ThreadPoolExecutor(PARALLEL_RUNS)
    runs = {}
    for script in selected:
        folder = str(tmp_path_factory.mktemp(f"smoke-{script}"))
        args = [part.format(**values, tmp=folder) for part in SMOKE[script][0]]
        command = [sys.executable, "-m", module_of(script), *args]
        runs[script] = pool.submit(subprocess.run, command, capture_output=True, text=True, env=env, cwd=folder,
                                   timeout=SMOKE_TIMEOUT_S)
    yield runs
    pool.shutdown(cancel_futures=True)


def inputs(request, tmp_path_factory, parts: list[str]) -> dict[str, str]:
    """The placeholders' values, each made only if a selected run uses it."""
    used = " ".join(parts)
    values = {}
    if "{tiny_gguf}" in used:
        values["tiny_gguf"] = request.getfixturevalue("tiny_gguf")
    if "{tiny}" in used:
        tiny_gguf = request.getfixturevalue("tiny_gguf")
        values["tiny"] = os.path.join(os.path.dirname(tiny_gguf), "hf")  # its Hugging Face source folder
    if "{url}" in used:
        values["url"] = request.getfixturevalue("tiny_delayed_server").base_url
    if "{trace}" in used:
        values["trace"] = write_trace(str(tmp_path_factory.mktemp("smoke-trace") / "run.steps.jsonl"))
    if "{sweep}" in used:
        values["sweep"] = write_sweep(str(tmp_path_factory.mktemp("smoke-sweep")))
    return values


def write_trace(path: str) -> str:
    """A step trace as `--trace-steps` writes it: 300 steps, mixed and decode-only, each ran
    0.8-1.3x its prediction."""
    with open(path, "w") as f:
        for i in range(300):
            prefill = 64 if i % 5 == 0 else 0
            slowdown = 0.8 + 0.05 * ((i * 7) % 11)
            record = StepRecord(step_id=i, start_time=1.79e9 + 0.04 * i, duration_s=0.03 * slowdown,
                                predicted_duration_s=0.03, prediction_error_p50=0.1, prediction_error_p90=0.2,
                                slo_margin=1.2, prefill_wait_guard=False,
                                forward_mode=ForwardMode.MIXED if prefill else ForwardMode.DECODE,
                                num_prefill_tokens=prefill, num_decode_tokens=8, num_requests=8 + (prefill > 0),
                                num_preemptions=0, kv_cache_usage=0.3, prefix_cache_queries=prefill,
                                prefix_cache_hits=0, prefix_cache_hit_rate=0.0)
            f.write(json.dumps(record.to_dict()) + "\n")
    return path


def write_sweep(folder: str) -> str:
    """A sweep's summary.json (rows as `chunkserve bench sweep` writes them) and machine.json: two
    systems of two rounds each, three fixed budgets and a policy, with the peer figure's workloads."""
    rows = []
    for index, config in enumerate(["budget 256", "budget 512", "budget 1024", "adaptive", "chunkserve (1)",
                                    "chunkserve (2)", "vLLM default dtype (1)", "vLLM default dtype (2)"]):
        rows.append({"config": config, "tbt_p99_ms": 400.0 / (index + 1), "long_ttft_p50_s": 1.0 + index / 4,
                     "workloads": {"scenario-a": {"output_tok_s": 100.0 + index},
                                   "decode-1": {"tbt_p50_ms": 30.0 + index},
                                   "decode-8": {"tbt_p50_ms": 40.0 + index}}})
    with open(os.path.join(folder, "summary.json"), "w") as f:
        json.dump(rows, f)
    with open(os.path.join(folder, "machine.json"), "w") as f:
        json.dump({"cpu": "test CPU", "cpu_family": "25", "cpu_model": "1", "cpus": "2", "avx512_flags": "",
                   "commit": "0000000", "date": "today"}, f)
    return folder

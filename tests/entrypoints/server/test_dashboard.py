"""/dashboard against a live server: four decode streams while a long prompt arrives (Scenario
B's shape) on the tiny model at budget 64. Over HTTP (every tier): the event stream carries
mixed steps, the long prompt's progress chunk by chunk and the server's state. In a real
headless Chromium (the long tier; Debian's `chromium`, installed here when missing and apt
can): the page draws a mixed bar, shows the prompt's progress, logs no error, and is
screenshotted."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest

from chunkserve.bench.browser import Browser, chromium_path
from chunkserve.engine.core import TEST_STEP_DELAY_ENV
from tests.entrypoints.server.disaggregation_support import prompt_of
from tests.entrypoints.server.tiny_server_support import start_tiny_server
from tests.server_process import ADMIN_API_KEY, Server, stop_server
from tests.tiny_model import STEP_DELAY_MS

LONG_PROMPT = 1500  # 24 chunks at budget 64
STREAMS = 4
DEADLINE_S = 120


class ScenarioB:
    """The streams, then, once the server runs them all, the long prompt: its chunks share steps
    with their decodes (sent first, it would take whole steps before them). Their answers' status
    codes."""

    def __init__(self, server: Server) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(STREAMS + 1)
        self.futures = [self.pool.submit(self._complete, server, prompt_of(20, seed), 60) for seed in range(STREAMS)]
        server.wait_until(lambda metrics: metrics["chunkserve:num_requests_running{}"] >= STREAMS)
        self.futures.append(self.pool.submit(self._complete, server, prompt_of(LONG_PROMPT, 99), 4))
        self.pool.shutdown(wait=False)  # (its threads finish their requests)

    @staticmethod
    def _complete(server: Server, prompt: list[int], max_tokens: int) -> int:
        with server.client() as http:
            return http.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                      "ignore_eos": True}).status_code

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def result(self, timeout: float | None = None) -> list[int]:
        return [f.result(timeout) for f in self.futures]


def snapshots(server: Server) -> Iterator[dict]:
    with httpx.stream("GET", server.base_url + "/dashboard/events", timeout=60,
                      headers={"Authorization": f"Bearer {ADMIN_API_KEY}"}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                yield json.loads(line[6:])


def test_a_live_viewer_gets_mixed_steps_prompt_progress_and_the_state(tiny_delayed_server):
    server = tiny_delayed_server
    mixed, progress, states, load = [], set(), [], None
    deadline = time.monotonic() + DEADLINE_S
    viewer = snapshots(server)
    try:
        for snapshot in viewer:
            assert time.monotonic() < deadline, f"not seen in {DEADLINE_S} s: mixed {len(mixed)}, progress {progress}"
            if load is None:  # the viewer is connected (the feed keeps steps from now on): the load starts
                load = ScenarioB(server)
                continue
            mixed += [s for s in snapshot["steps"] if s["num_decode_tokens"] and s["num_prefill_tokens"]]
            progress |= {(r["computed"], r["chunks"]) for r in snapshot["requests"] if r["prompt_len"] == LONG_PROMPT}
            if snapshot["state"] is not None:
                states.append(snapshot["state"])
            if load.done() and mixed:
                break
    finally:
        viewer.close()  # the viewer leaves: its stream ends
    assert load.result() == [200] * (STREAMS + 1)
    assert mixed and all(s["forward_mode"] == "MIXED" and s["num_prefill_tokens"] + s["num_decode_tokens"] <= 64
                         for s in mixed)
    assert any(chunk[3] == LONG_PROMPT for s in mixed for chunk in s["prompt_chunks"]), [s["prompt_chunks"] for s in mixed]
    partial = sorted(p for p in progress if p[0] < LONG_PROMPT)  # (computed, chunks) of the long prompt's row
    assert len(partial) >= 2 and partial[0][1] < partial[-1][1]  # seen part computed, advancing chunk by chunk
    assert all(0 < computed <= 64 * chunks for computed, chunks in partial)
    assert any(s["running"] >= STREAMS for s in states) and all(s["kv_blocks"] > 0 for s in states)


# ----- in a real browser --------------------------------------------------------------------------------------------


def install_chromium() -> str | None:
    """Chromium's path, installing Debian's package where it is missing and apt can (CI has apt)."""
    if chromium_path() is None and shutil.which("apt-get") and os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], capture_output=True, timeout=900,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        if chromium_path() is None:  # (a stale package index)
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=900)
            subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], capture_output=True, timeout=900,
                           env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    return chromium_path()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    if install_chromium() is None:
        pytest.skip("no Chromium, and it could not be installed here (apt-get install chromium, as root); "
                    "CHUNKSERVE_CHROMIUM may name one")
    with Browser.start() as started:
        yield started


@pytest.fixture(scope="module")
def open_dashboard_server(tmp_path_factory, tiny_gguf) -> Iterator[Server]:
    """A tiny server whose dashboard needs no key (--dashboard-without-auth), stepping with the test delay."""
    server = start_tiny_server(tmp_path_factory, tiny_gguf, "--dashboard-without-auth", name="dashboard",
                               env={TEST_STEP_DELAY_ENV: str(STEP_DELAY_MS)})
    yield server
    stop_server(server)


def wait_for(browser: Browser, condition: str) -> None:
    try:
        browser.wait_for(condition, timeout_s=DEADLINE_S)
    except Exception:
        raise AssertionError(f"{condition} never held; page errors {browser.errors}; console {browser.console[-5:]}")


@pytest.mark.slow  # Chromium (installed on first use): the long tier; the event stream is checked in every tier
def test_the_page_draws_the_mixed_batch_and_the_prompts_progress_in_a_real_browser(browser, open_dashboard_server,
                                                                                  tmp_path):
    server = open_dashboard_server
    browser.open(server.base_url + "/dashboard")
    wait_for(browser, "document.getElementById('status').textContent === 'live'")
    load = ScenarioB(server)
    # a request row of the long prompt, part computed
    wait_for(browser, f"[...document.querySelectorAll('tr.request')].some(r => r.dataset.promptLen == '{LONG_PROMPT}'"
                      f" && +r.dataset.computed > 0 && +r.dataset.computed < {LONG_PROMPT})")
    # a bar with decode rows and prompt tokens in it
    wait_for(browser, "document.querySelectorAll('g.step.mixed rect.decode').length > 0 && "
                      "document.querySelectorAll('g.step.mixed rect.prefill').length > 0")
    assert load.result(timeout=DEADLINE_S) == [200] * (STREAMS + 1)
    assert int(browser.evaluate("document.getElementById('step-count').textContent")) > 0
    assert browser.evaluate("document.getElementById('running').textContent") != "-"
    # hovering a step shows its record
    box = browser.evaluate("(() => { const g = document.querySelector('g.step.mixed rect'); const b = "
                           "g.getBoundingClientRect(); return [b.x + b.width / 2, b.y + b.height / 2]; })()")
    browser.send("Input.dispatchMouseEvent", {"type": "mouseMoved", "x": box[0], "y": box[1]})
    wait_for(browser, "document.getElementById('tooltip').textContent.includes('num_prefill_tokens')")
    shot = browser.screenshot(str(tmp_path / "dashboard.png"))
    assert os.path.getsize(shot) > 10_000
    assert browser.errors == [], browser.errors


@pytest.mark.slow
def test_a_bench_plot_html_file_shows_its_run_without_a_server(browser, tmp_path):
    from chunkserve.entrypoints.cli import main

    steps = [{"step_id": i, "start_time": 100 + i * 0.05, "duration_s": 0.04, "predicted_duration_s": 0.035,
              "forward_mode": "MIXED", "num_prefill_tokens": 48, "num_decode_tokens": 16, "num_draft_tokens": 0,
              "num_requests": 17, "num_preemptions": 0, "kv_cache_usage": 0.2, "prefix_cache_hit_rate": 0.0,
              "kv_transfer_bytes": 0, "prefill_wait_guard": False, "slo_margin": 1.0, "prompt_chunks": []}
             for i in range(50)]
    trace = tmp_path / "steps.jsonl"
    trace.write_text("".join(json.dumps(s) + "\n" for s in steps))
    result = {"label": "run", "workload": "random", "bench_start": 100.0, "config": {},
              "requests": [{"kind": "stream", "ok": True, "send_time": 100.0, "token_times": [100.2, 100.25, 100.3],
                            "prompt_len": 10, "output_len": 3}]}
    (tmp_path / "result.json").write_text(json.dumps(result))
    page = tmp_path / "run.html"
    main(["bench", "plot", str(tmp_path / "result.json"), "--trace", str(trace), "--html", str(page)])
    browser.open(page.as_uri())
    wait_for(browser, "document.querySelectorAll('g.step.mixed').length === 50")
    assert browser.evaluate("document.getElementById('ttft-p50').textContent") == "200"
    assert browser.errors == [], browser.errors

"""docs/grafana.json against a live server: after a few requests, every series each panel's
PromQL reads is in /metrics with the labels the expression selects (`$model_name` = the served
name), and the rates and heatmaps have something to draw. The server runs a tiny model that
drafts for itself (speculative decoding, every draft accepted), so the acceptance panel fills too."""

from __future__ import annotations

import json
import pathlib
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.hostile_server import TINY_MAX_MODEL_LEN, build_tiny_model
from tests.server_process import start_server, stop_server

DASHBOARD = pathlib.Path(__file__).parents[3] / "docs" / "grafana.json"
SERVED_NAME = "tiny-dashboard"
SERIES = re.compile(r"(chunkserve:[a-z0-9_:]+)(?:\{([^}]*)\})?")
MATCHER = re.compile(r'\s*([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"([^"]*)"\s*')
CUMULATIVE = ("_total", "_sum", "_count", "_bucket")  # counters and histograms: a rate() of them must move
PROMPT = list(range(1000, 1040))  # two full blocks and a part: the second send finds the two in the prefix cache


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = build_tiny_model(str(tmp_path_factory.mktemp("grafana-model")))
    drafts = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 2, "policy": "always"}
    started = start_server(tmp_path_factory, "--model", model_dir, "--max-model-len", str(TINY_MAX_MODEL_LEN),
                           "--served-model-name", SERVED_NAME, "--speculative-config", json.dumps(drafts),
                           name="grafana-server", env={"OMP_NUM_THREADS": "1"})
    yield started
    stop_server(started)


@pytest.fixture(scope="module")
def scrape(server) -> list:
    """/metrics' samples after three requests (one a repeat, one streamed) have finished."""
    with server.client() as http:
        for body in ({"prompt": PROMPT}, {"prompt": PROMPT}, {"prompt": "Hello there", "stream": True}):
            response = http.post("/v1/completions", json={**body, "model": SERVED_NAME, "max_tokens": 8,
                                                          "temperature": 0, "ignore_eos": True})
            assert response.status_code == 200, response.text
        server.wait_until(lambda m: m["chunkserve:e2e_request_latency_seconds_count{}"] == 3)
        text = http.get("/metrics").text
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panel_queries() -> list[tuple[str, str]]:
    """(panel and target, PromQL) of every panel target."""
    return [(f"{panel['title']} {target['refId']}", target["expr"])
            for panel in dashboard()["panels"] for target in panel["targets"]]


def series_read(expr: str) -> list[tuple[str, dict[str, str]]]:
    """Each chunkserve: series an expression reads, with the labels it selects on (only `=`
    matchers: the check below understands no others)."""
    found = []
    for name, selector in SERIES.findall(expr):
        labels = {}
        for matcher in filter(str.strip, selector.split(",")):
            label, op, value = MATCHER.fullmatch(matcher).groups()
            assert op == "=", f"{expr}: matcher {matcher!r} is not an equality"
            labels[label] = value.replace("$model_name", SERVED_NAME)
        found.append((name, labels))
    return found


def test_the_dashboard_reads_chunkserve_names_only():
    queries = panel_queries()
    assert len(queries) >= 16
    for where, expr in queries:
        assert "vllm:" not in expr, where
        assert series_read(expr), f"{where} reads no chunkserve: series: {expr}"
        assert all(labels.get("model_name") == SERVED_NAME for _, labels in series_read(expr)), \
            f"{where} does not select the $model_name variable: {expr}"


def test_the_model_name_variable_offers_the_served_name(scrape):
    variable, = [v for v in dashboard()["templating"]["list"] if v["name"] == "model_name"]
    (name, labels), = series_read(variable["query"]["query"])
    offered = {s.labels.get("model_name") for s in scrape if s.name == name and labels.items() <= s.labels.items()}
    assert SERVED_NAME in offered


@pytest.mark.parametrize("where, expr", panel_queries(), ids=[where for where, _ in panel_queries()])
def test_every_panel_has_data_after_requests(scrape, where, expr):
    for name, labels in series_read(expr):
        values = [s.value for s in scrape if s.name == name and labels.items() <= s.labels.items()]
        assert values, f"{where}: no {name} sample with {labels} in /metrics"
        if name.endswith(CUMULATIVE):
            assert max(values) > 0, f"{where}: {name} did not move after the requests"


# Every series vLLM's own dashboard reads (examples/online_serving/prometheus_grafana/grafana.json in
# vllm-project/vllm), with its `vllm:` prefix renamed: a vLLM user's dashboard works after that rename.
VLLM_DASHBOARD_SERIES = (
    "e2e_request_latency_seconds_bucket", "e2e_request_latency_seconds_sum", "e2e_request_latency_seconds_count",
    "prompt_tokens_total", "generation_tokens_total",
    "time_per_output_token_seconds_bucket", "time_per_output_token_seconds_sum",
    "time_per_output_token_seconds_count", "num_requests_running", "num_requests_waiting",
    "time_to_first_token_seconds_bucket", "time_to_first_token_seconds_sum", "time_to_first_token_seconds_count",
    "gpu_cache_usage_perc", "request_prompt_tokens_bucket", "request_generation_tokens_bucket",
    "request_success_total", "request_queue_time_seconds_sum", "request_prefill_time_seconds_sum",
    "request_decode_time_seconds_sum", "request_max_num_generation_tokens_sum",
)


@pytest.mark.parametrize("series", VLLM_DASHBOARD_SERIES)
def test_vllms_own_dashboard_reads_series_that_exist_after_a_prefix_rename(scrape, series):
    values = [s.value for s in scrape if s.name == f"chunkserve:{series}" and s.labels.get("model_name") == SERVED_NAME]
    assert values, f"chunkserve:{series} (vLLM's dashboard reads vllm:{series}) is not in /metrics"
    if series.endswith(CUMULATIVE):
        assert max(values) > 0, f"chunkserve:{series} did not move after the requests"

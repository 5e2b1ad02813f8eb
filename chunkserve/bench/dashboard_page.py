"""The dashboard's page (static/dashboard.html): served live by the server's /dashboard
(entrypoints/server/dashboard.py), or written as one HTML file with a run's data embedded by
`chunkserve bench plot --html`, which opens anywhere without a server."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

# a step record's fields the page draws (the --trace-steps schema's names: a trace file and the live feed alike)
STEP_FIELDS = ("step_id", "start_time", "duration_s", "predicted_duration_s", "forward_mode", "num_prefill_tokens",
               "num_decode_tokens", "num_draft_tokens", "num_accepted_tokens", "num_requests", "num_preemptions",
               "kv_cache_usage", "prefix_cache_hit_rate", "kv_transfer_bytes", "prefill_wait_guard", "slo_margin",
               "prompt_chunks")
EMBEDDED_SLOT = '<script id="embedded" type="application/json">null</script>'


def page_steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Step records (a --trace-steps file's lines) with the fields the page draws only."""
    return [{name: record.get(name) for name in STEP_FIELDS} for record in records]


def page_html(embedded: dict[str, Any] | None = None) -> str:
    """The page; with `embedded` ({"name", "result": a bench result, "steps": step records,
    "token_budget", "tbt_slo_ms"}), the page shows that instead of connecting to a server."""
    page = resources.files("chunkserve.bench").joinpath("static/dashboard.html").read_text()
    if embedded is None:
        return page
    # "</" would end the script element early: JSON allows "<\/" for it
    data = json.dumps(embedded, separators=(",", ":")).replace("</", "<\\/")
    return page.replace(EMBEDDED_SLOT, f'<script id="embedded" type="application/json">{data}</script>')

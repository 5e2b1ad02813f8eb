"""/dashboard: the engine's steps live in a browser, served by the server itself.

- `GET /dashboard` (open): the page, bench/static/dashboard.html (no library, nothing fetched from
  anywhere else). It reads its data from /dashboard/events with the admin key the user types
  in (kept in the tab's sessionStorage and sent as a header, never put in a URL), or without a
  key where the server runs with --dashboard-without-auth. The same page opens a --trace-steps
  file or a bench result (`chunkserve bench plot --html` writes it with one embedded).
- `GET /dashboard/events?window=S` (the admin key, or open with --dashboard-without-auth):
  Server-Sent Events, one snapshot (dashboard_feed.py) every EVENT_INTERVAL_S with the steps
  since the previous one and TBT/TTFT percentiles over the last S seconds; it ends when the
  client leaves or the server stops.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import HTMLResponse, StreamingResponse

from chunkserve.bench.dashboard_page import page_html
from chunkserve.entrypoints.server.access import AccessRouters
from chunkserve.entrypoints.server.dashboard_feed import MAX_WINDOW_S, DashboardFeed
from chunkserve.errors import InvalidRequestError

EVENT_INTERVAL_S = 0.25
routers = AccessRouters()


@routers.open.get("/dashboard")
async def page(raw: Request):
    return HTMLResponse(page_html(), headers={"Cache-Control": "no-store"})


@routers.dashboard.get("/dashboard/events")
async def events(raw: Request, window: float = 60.0):
    if not 1.0 <= window <= MAX_WINDOW_S:
        raise InvalidRequestError(f"window must be between 1 and {MAX_WINDOW_S:g} seconds, got {window:g}", "window")
    feed: DashboardFeed = raw.app.state.dashboard_feed
    return StreamingResponse(_snapshots(raw, feed, window), media_type="text/event-stream",
                             headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})


async def _snapshots(raw: Request, feed: DashboardFeed, window: float) -> AsyncIterator[str]:
    """A snapshot at once, then every EVENT_INTERVAL_S, each with the steps after the last one
    sent; until the client leaves (Starlette then cancels this) or the server stops."""
    last = -1
    while not feed.closed:
        snapshot = feed.snapshot(last, window)
        last = snapshot["last_step"]
        yield f"data: {json.dumps(snapshot, separators=(',', ':'))}\n\n"
        await asyncio.sleep(EVENT_INTERVAL_S)
        if await raw.is_disconnected():
            return

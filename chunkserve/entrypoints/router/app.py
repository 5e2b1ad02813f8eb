"""`chunkserve router --pd-disaggregation`: the HTTP front of prefill/decode disaggregation.

Clients talk to the router as to one `chunkserve serve`; each generation request goes to a
prefill and a decode instance at once (relay.py) and the decode's answer comes back. The
router holds no model and does no compute: one pooled HTTP client, the instances' health
(pool.py) and the metrics (metrics.py). It starts serving at once, whether or not the
instances are up yet; until one of each role is healthy it answers 503 with Retry-After.

On SIGINT/SIGTERM uvicorn stops accepting connections and lets the answers in flight finish
for `SHUTDOWN_GRACE_S` seconds; those still running are then cancelled, which closes their
upstream connections (an abort upstream), and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from chunkserve.entrypoints.router.args import RouterConfig, config_from_cli_args
from chunkserve.entrypoints.router.metrics import RouterMetrics
from chunkserve.entrypoints.router.pool import InstancePool
from chunkserve.entrypoints.router.relay import (
    Answer,
    PDExchange,
    Relay,
    error_answer,
)
from chunkserve.version import VERSION

logger = logging.getLogger(__name__)
RELAYED_ROUTES = ("/v1/completions", "/v1/chat/completions", "/generate")
CONNECT_TIMEOUT_S = 10.0  # opening an upstream connection; reads have no timeout but --request-timeout
MAX_IDLE_CONNECTIONS = 512  # kept open for reuse, over all instances
# Idle connections are dropped well before uvicorn's 5 s keep-alive timeout, so that the router
# never sends a request on a connection the server is closing (a spurious "unreachable").
KEEPALIVE_EXPIRY_S = 2.0
SHUTDOWN_GRACE_S = 30.0


def build_app(config: RouterConfig) -> FastAPI:
    metrics = RouterMetrics([("prefill", spec.url) for spec in config.prefill]
                            + [("decode", spec.url) for spec in config.decode])
    pool = InstancePool(config, metrics)
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
                               limits=httpx.Limits(max_connections=None, keepalive_expiry=KEEPALIVE_EXPIRY_S,
                                                   max_keepalive_connections=MAX_IDLE_CONNECTIONS))
    relay = Relay(client, pool, metrics, config.request_timeout,
                  retry_after=str(max(1, math.ceil(config.health_check_interval))))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        watcher = asyncio.create_task(pool.watch(client))
        yield
        watcher.cancel()
        with suppress(asyncio.CancelledError):
            await watcher
        await client.aclose()

    app = FastAPI(title="chunkserve router", version=VERSION, lifespan=lifespan)
    _add_error_handlers(app)

    async def relayed(request: Request) -> PDExchange:
        return PDExchange(relay, request.url.path, await request.body(), request.headers)

    for route in RELAYED_ROUTES:  # plain Starlette routes: FastAPI wants a Response (and sets its background)
        app.router.add_route(route, relayed, methods=["POST"])

    @app.get("/health")
    async def health():
        role = pool.missing_role()
        return _as_response(relay.unavailable(role)) if role is not None else {}

    @app.get("/v1/models")
    async def models(request: Request):
        return _as_response(await _models(relay, request))

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _models(relay: Relay, request: Request) -> Answer:
    """A healthy decode instance's model list (the decode instances serve the answers)."""
    arrival = time.monotonic()
    decode = relay.pool.pick("decode")
    if decode is None:
        answer = relay.unavailable("decode")
    else:
        try:
            answer = await relay.fetch(decode, "/v1/models", request.headers)
        finally:
            relay.pool.release(decode)
    relay.metrics.request_done("/v1/models", answer.status, time.monotonic() - arrival)
    return answer


def _as_response(answer: Answer) -> Response:
    return Response(answer.body, answer.status, {k.decode(): v.decode() for k, v in answer.headers})


def _add_error_handlers(app: FastAPI) -> None:
    """Errors of the router itself in OpenAI's shape, like the upstream servers' own."""

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException):
        error_type = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return _as_response(error_answer(error.status_code, str(error.detail), error_type))

    @app.exception_handler(Exception)
    async def internal(_: Request, error: Exception):
        logger.exception("unhandled error")
        return _as_response(error_answer(500, f"internal error: {error!r}", "internal_error"))


def run_router(config: RouterConfig) -> None:
    app = build_app(config)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                                           access_log=config.log_level == "debug",
                                           timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
    # uvicorn re-raises the signal it stopped on once it is done; a handler that only
    # returns lets the process end normally (exit 0) after the graceful shutdown.
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, lambda *_: None)
    logger.info("routing on http://%s:%d: prefill %s; decode %s", config.host, config.port,
                " ".join(spec.url for spec in config.prefill), " ".join(spec.url for spec in config.decode))
    server.run()
    logger.info("router stopped")


def main(args: argparse.Namespace) -> None:
    """`chunkserve router ...`: exits 2 with `error: ...` on a bad command line."""
    try:
        config = config_from_cli_args(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    logging.getLogger("chunkserve").setLevel(config.log_level.upper())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not one log line per upstream request
    run_router(config)

"""The HTTP server: the app (the API modules' routes, error bodies, guards) and the process
around it.

The port is bound before the engine loads (a port in use fails at once, not after a minute of
loading), and answers once the engine is ready, so a client that sees the port answering can
be served. On SIGINT/SIGTERM uvicorn stops accepting connections and lets in-flight requests
finish for `--shutdown-timeout` seconds; whatever is still running is then aborted, the
engine core stops and the process exits 0. If the engine core dies instead, its requests
fail at once and the server exits 1, so a supervisor restarts it (vLLM's behaviour); with
`--restart-engine-on-failure` it starts a new engine core and answers 503 with Retry-After
meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from chunkserve.config.engine import EngineArgs
from chunkserve.engine.async_llm import AsyncLLM
from chunkserve.entrypoints.args import ServerArgs
from chunkserve.entrypoints.server import dashboard, openai_api, sglang_api, vllm_api
from chunkserve.entrypoints.server.access import include_routers
from chunkserve.entrypoints.server.dashboard_feed import DashboardFeed
from chunkserve.entrypoints.server.http_protocol import header_timeout_protocol
from chunkserve.entrypoints.server.metrics import EngineMetrics
from chunkserve.entrypoints.server.middleware import ApiKeyMiddleware, BodySizeLimitMiddleware
from chunkserve.entrypoints.server.openai_api import OpenAIServing
from chunkserve.entrypoints.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from chunkserve.entrypoints.server.openapi import document_request_bodies
from chunkserve.entrypoints.server.serving import ServingOptions, error_response
from chunkserve.entrypoints.server.sglang_api import SGLangServing
from chunkserve.entrypoints.server.sglang_protocol import GenerateRequest
from chunkserve.entrypoints.server.stats_log import INTERVAL_S as STATS_INTERVAL_S
from chunkserve.entrypoints.server.startup import Startup
from chunkserve.entrypoints.server.stats_log import StatsLogger
from chunkserve.entrypoints.server.trace import StepTraceWriter
from chunkserve.entrypoints.server.vllm_api import VLLMServing
from chunkserve.errors import (
    EngineDeadError,
    InvalidRequestError,
    KVTransferError,
    ServerOverloadedError,
)
from chunkserve.version import VERSION

logger = logging.getLogger(__name__)
MAX_VALIDATION_ERRORS = 3
SHUTDOWN_BACKSTOP_S = 5.0  # after the grace period and the aborts, uvicorn cancels what is left
ENGINE_DEATH_SHUTDOWN_S = 3.0  # a dead engine's requests have failed already: the server exits quickly
RESTART_RETRY_AFTER_S = "10"  # what a client is told to wait while a new engine core loads


def build_app(engine: AsyncLLM, metrics: EngineMetrics, model_names: list[str], args: ServerArgs,
              engine_args: EngineArgs) -> FastAPI:
    """`model_names`: what requests may name; the first is what responses name. The routes are
    the API modules' (openai_api, sglang_api, vllm_api), each with its access class."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        engine.shutdown()  # aborts whatever the graceful-shutdown window left running

    docs = {"docs_url": None, "redoc_url": None, "openapi_url": None} if args.disable_fastapi_docs else {}
    app = FastAPI(title="chunkserve", version=VERSION, lifespan=lifespan, **docs)
    options = ServingOptions.from_args(args)
    app.state.openai_serving = OpenAIServing(engine, model_names, options, metrics)
    app.state.sglang_serving = SGLangServing(engine, model_names, options, metrics)
    app.state.vllm_serving = VLLMServing(engine, model_names, options, metrics)
    app.state.engine_args, app.state.server_args = engine_args, args
    app.state.dashboard_feed = feed = DashboardFeed(engine.info.max_num_batched_tokens, engine_args.tbt_slo_ms)
    engine.observers.append(feed.observe)
    _add_error_handlers(app, RESTART_RETRY_AFTER_S if args.restart_engine_on_failure else None)
    access = include_routers(app, [openai_api.routers, sglang_api.routers, vllm_api.routers, dashboard.routers],
                             args.protect_metrics, args.dashboard_without_auth)
    document_request_bodies(app, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                                  "/generate": GenerateRequest})
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=args.max_request_body_bytes,
                       read_timeout_s=args.request_read_timeout, unlimited_paths=frozenset({"/import_request"}))
    app.add_middleware(  # checked before the body is read
        ApiKeyMiddleware,
        api_key=args.api_key or os.environ.get("CHUNKSERVE_API_KEY") or os.environ.get("VLLM_API_KEY") or None,
        admin_api_key=args.admin_api_key or os.environ.get("CHUNKSERVE_ADMIN_API_KEY") or None, access=access)
    app.add_middleware(  # outermost: a browser's preflight (OPTIONS, no credentials) is answered here
        CORSMiddleware, allow_origins=args.allowed_origins, allow_methods=args.allowed_methods,
        allow_headers=args.allowed_headers, allow_credentials=args.allow_credentials)
    return app


def _add_error_handlers(app: FastAPI, retry_after_dead: str | None) -> None:
    """`retry_after_dead`: the Retry-After of a 503 while the engine is dead (it is being restarted)."""
    @app.exception_handler(InvalidRequestError)
    async def invalid_request(_: Request, error: InvalidRequestError):
        return error_response(400, str(error), "invalid_request_error", error.param)

    @app.exception_handler(ValidationError)  # a body (parsed in the route)
    @app.exception_handler(RequestValidationError)  # query parameters (parsed by FastAPI)
    async def malformed_input(_: Request, error: ValidationError | RequestValidationError):
        message, param = _describe_validation_error(error)
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(ServerOverloadedError)
    async def overloaded(_: Request, error: ServerOverloadedError):
        return error_response(503, str(error), "server_overloaded", headers={"Retry-After": "1"})

    @app.exception_handler(KVTransferError)
    async def kv_transfer_failed(_: Request, error: KVTransferError):
        return error_response(503, str(error), "service_unavailable", headers={"Retry-After": "1"})

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, error: EngineDeadError):
        headers = {"Retry-After": retry_after_dead} if retry_after_dead else None
        return error_response(503, str(error), "service_unavailable", headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException):
        error_type = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return error_response(error.status_code, str(error.detail), error_type, headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def internal(_: Request, error: Exception):
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {error!r}", "internal_error")


def _describe_validation_error(error: ValidationError | RequestValidationError) -> tuple[str, str | None]:
    """Pydantic's errors -> one readable message and the first offending field."""
    parts, param = [], None
    for item in error.errors():
        if item["type"] == "json_invalid":
            return f"malformed JSON: {item.get('ctx', {}).get('error', item['msg'])}", None
        location = [str(p) for p in item["loc"] if p not in ("body", "query")]
        field = location[0] if location else None
        param = param or field
        text = f"{'.'.join(location) or 'body'}: {item['msg']}"
        if text not in parts:
            parts.append(text)
    shown = "; ".join(parts[:MAX_VALIDATION_ERRORS]) + ("; ..." if len(parts) > MAX_VALIDATION_ERRORS else "")
    return f"invalid request: {shown}", param


class _GracefulServer(uvicorn.Server):
    """uvicorn, plus: requests still running `grace_s` after the stop signal are aborted in
    the engine, so their responses end properly (finish_reason "abort", then [DONE])
    instead of being cut."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM, grace_s: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.grace_s = grace_s

    async def shutdown(self, sockets=None) -> None:
        self.config.app.state.dashboard_feed.close()  # live views end now: they are not requests to wait for
        aborter = asyncio.get_running_loop().call_later(self.grace_s, self.engine.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            aborter.cancel()


def run_server(startup: Startup) -> None:
    """Serve until stopped, over what `begin_serving` bound and started."""
    engine_args, server_args, listener = startup.engine_args, startup.server_args, startup.listener
    multiprocess = startup.engine is not None
    try:
        engine = AsyncLLM.from_engine_args(engine_args, max_waiting_requests=server_args.max_waiting_requests,
                                           multiprocess=multiprocess, max_unread_outputs=server_args.max_unread_outputs,
                                           started=startup.engine)
    except BaseException:
        startup.abandon()
        raise
    model_names = server_args.served_model_name or [engine.info.model_name]
    metrics = EngineMetrics(model_names[0], max_model_len=engine.info.max_model_len, engine_args=engine_args,
                            metrics_compat=tuple(server_args.metrics_compat or ()))
    trace = _add_observers(engine, metrics, server_args)
    app = build_app(engine, metrics, model_names, server_args, engine_args)
    server = _GracefulServer(_uvicorn_config(app, server_args), engine, server_args.shutdown_timeout)
    failed = False

    def on_engine_death(reason: str) -> None:
        nonlocal failed
        if server_args.restart_engine_on_failure and multiprocess:
            logger.error("the engine core died (%s); starting a new one (requests get 503 meanwhile)", reason)
            try:
                engine.restart()
                logger.info("the new engine core is serving")
                return
            except Exception:
                logger.exception("the engine core could not be restarted")
        else:
            logger.error("the engine core died (%s); the server exits so that its supervisor can restart it "
                         "(--restart-engine-on-failure restarts the engine core instead)", reason)
        failed = True
        server.config.timeout_graceful_shutdown = ENGINE_DEATH_SHUTDOWN_S
        server.should_exit = True

    engine.on_engine_death = on_engine_death
    # uvicorn re-raises the signal it stopped on once it is done; a handler that only
    # returns lets the process end normally (exit 0) after the graceful shutdown.
    for stop_signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop_signal, lambda *_: None)
    scheme = "https" if server_args.ssl_certfile else "http"
    logger.info("serving %s on %s://%s:%d", model_names[0], scheme, server_args.host, server_args.port)
    try:
        server.run(sockets=[listener])
    finally:
        engine.shutdown()
        if trace is not None:
            trace.close()
    if failed:
        logger.error("server stopped: the engine core died")
        sys.exit(1)
    logger.info("server stopped")


def _add_observers(engine: AsyncLLM, metrics: EngineMetrics, server_args: ServerArgs) -> StepTraceWriter | None:
    """What watches each engine step: the metrics, the stats log and the step trace (returned, to be closed)."""
    engine.observers.append(metrics.observe)
    if not server_args.disable_log_stats:
        engine.observers.append(StatsLogger(float(os.environ.get("CHUNKSERVE_LOG_STATS_INTERVAL", STATS_INTERVAL_S))
                                            ).observe)
    trace = StepTraceWriter(server_args.trace_steps) if server_args.trace_steps else None
    if trace is not None:
        engine.observers.append(trace.observe)
    return trace


def _uvicorn_config(app: FastAPI, server_args: ServerArgs) -> uvicorn.Config:
    uvicorn_level = server_args.uvicorn_log_level or server_args.log_level
    return uvicorn.Config(
        app, log_level=uvicorn_level, root_path=server_args.root_path or "",
        timeout_graceful_shutdown=server_args.shutdown_timeout + SHUTDOWN_BACKSTOP_S,
        access_log=uvicorn_level in ("debug", "trace") and not server_args.disable_uvicorn_access_log,
        http=header_timeout_protocol(server_args.request_read_timeout), ssl_keyfile=server_args.ssl_keyfile,
        ssl_certfile=server_args.ssl_certfile, ssl_ca_certs=server_args.ssl_ca_certs,
        ssl_cert_reqs=server_args.ssl_cert_reqs,
    )

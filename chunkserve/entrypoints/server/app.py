"""The HTTP server: routes, error bodies, guards, and the process around them.

The engine loads before the port opens, so a client that sees the port answering can be
served. On SIGINT/SIGTERM uvicorn stops accepting connections and lets in-flight requests
finish for `--shutdown-timeout` seconds; whatever is still running is then aborted, the
engine core stops and the process exits 0. If the engine core dies instead, its requests
fail at once and the server exits 1, so a supervisor restarts it (vLLM's behaviour); with
`--restart-engine-on-failure` it starts a new engine core and answers 503 with Retry-After
meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from chunkserve.config.engine import EngineArgs
from chunkserve.engine.async_llm import AsyncLLM
from chunkserve.entrypoints.args import ServerArgs
from chunkserve.entrypoints.server.http_protocol import header_timeout_protocol
from chunkserve.entrypoints.server.metrics import EngineMetrics
from chunkserve.entrypoints.server.middleware import (
    ApiKeyMiddleware,
    BodySizeLimitMiddleware,
)
from chunkserve.entrypoints.server.openapi import document_request_bodies
from chunkserve.entrypoints.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    error_body,
)
from chunkserve.entrypoints.server.serving import Serving
from chunkserve.entrypoints.server.trace import StepTraceWriter
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
ADMIN_PATHS = frozenset({"/reset_prefix_cache", "/debug/steps", "/debug/check", "/export_request", "/import_request"})


def build_app(engine: AsyncLLM, metrics: EngineMetrics, model_name: str, args: ServerArgs,
              engine_args: EngineArgs) -> FastAPI:
    serving = Serving(engine, model_name, args.max_prompts_per_request)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        engine.shutdown()  # aborts whatever the graceful-shutdown window left running

    app = FastAPI(title="chunkserve", version=VERSION, lifespan=lifespan)
    _add_error_handlers(app, RESTART_RETRY_AFTER_S if args.restart_engine_on_failure else None)

    # Bodies are parsed here rather than by FastAPI so that any Content-Type is read as JSON
    # (curl -d sends form-encoded) and every parse error becomes one OpenAI error body.
    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await serving.completions(CompletionRequest.model_validate_json(await raw.body()), raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await serving.chat(ChatCompletionRequest.model_validate_json(await raw.body()), raw)

    @app.post("/generate")
    async def generate(raw: Request):
        return await serving.generate(GenerateRequest.model_validate_json(await raw.body()), raw)

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "chunkserve",
                "max_model_len": engine.info.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        if not engine.is_running:
            raise EngineDeadError("the engine is not running")
        return {}

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.get("/server_info")
    async def server_info():
        """What a router needs to know of this instance (open, like /health)."""
        mode, backend = engine_args.disaggregation_mode, engine_args.disaggregation_transfer_backend
        return {"model": model_name, "version": VERSION, "max_model_len": engine.info.max_model_len,
                "disaggregation_mode": mode, "disaggregation_transfer_backend": None if mode == "null" else backend,
                "disaggregation_bootstrap_port":
                    engine_args.disaggregation_bootstrap_port if mode == "prefill" else None}

    @app.get("/metrics")
    async def prometheus_metrics():
        metrics.observe_frontend(engine.num_unread_aborts)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        if not await engine.reset_prefix_cache():
            return _error(409, "the prefix cache can only be reset while no request is running or waiting; "
                               "retry when the server is idle", "conflict_error")
        return {}

    @app.post("/export_request")
    async def export_request(raw: Request, rid: str, mode: Literal["copy", "pause"] = "copy"):
        """A request in flight as a snapshot (application/octet-stream) that /import_request on a
        server of the same model continues; `pause` ends it here (finish_reason "abort")."""
        return await serving.export_request(rid, mode, await raw.body())

    @app.post("/import_request")
    async def import_request(raw: Request, stream: bool = False):
        """Continue a request from /export_request's bytes (the body); answered like /generate."""
        return await serving.import_request(await raw.body(), stream, raw)

    @app.get("/debug/steps")
    async def debug_steps(last: int = 100):
        if last < 1:
            raise InvalidRequestError(f"last must be at least 1, got {last}", "last")
        records = list(engine.step_records)[-last:]  # list() of a deque is atomic under the GIL
        return {"steps": [record.to_dict() for record in records]}

    @app.get("/debug/check")
    async def debug_check():
        """The engine's self-check: ok when idle with every KV block free or cached and no request left."""
        return await engine.check()

    document_request_bodies(app, {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
                                  "/generate": GenerateRequest})
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=args.max_request_body_bytes,
                       read_timeout_s=args.request_read_timeout, unlimited_paths=frozenset({"/import_request"}))
    app.add_middleware(  # outermost: checked before the body is read
        ApiKeyMiddleware, api_key=args.api_key or os.environ.get("CHUNKSERVE_API_KEY") or None,
        admin_api_key=args.admin_api_key or os.environ.get("CHUNKSERVE_ADMIN_API_KEY") or None,
        admin_paths=ADMIN_PATHS)
    return app


def _error(status: int, message: str, error_type: str, param: str | None = None,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, error_type, status, param), status_code=status, headers=headers)


def _add_error_handlers(app: FastAPI, retry_after_dead: str | None) -> None:
    """`retry_after_dead`: the Retry-After of a 503 while the engine is dead (it is being restarted)."""
    @app.exception_handler(InvalidRequestError)
    async def invalid_request(_: Request, error: InvalidRequestError):
        return _error(400, str(error), "invalid_request_error", error.param)

    @app.exception_handler(ValidationError)  # a body (parsed in the route)
    @app.exception_handler(RequestValidationError)  # query parameters (parsed by FastAPI)
    async def malformed_input(_: Request, error: ValidationError | RequestValidationError):
        message, param = _describe_validation_error(error)
        return _error(400, message, "invalid_request_error", param)

    @app.exception_handler(ServerOverloadedError)
    async def overloaded(_: Request, error: ServerOverloadedError):
        return _error(503, str(error), "server_overloaded", headers={"Retry-After": "1"})

    @app.exception_handler(KVTransferError)
    async def kv_transfer_failed(_: Request, error: KVTransferError):
        return _error(503, str(error), "service_unavailable", headers={"Retry-After": "1"})

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, error: EngineDeadError):
        headers = {"Retry-After": retry_after_dead} if retry_after_dead else None
        return _error(503, str(error), "service_unavailable", headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, error: HTTPException):
        error_type = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return _error(error.status_code, str(error.detail), error_type, headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def internal(_: Request, error: Exception):
        logger.exception("unhandled error")
        return _error(500, f"internal error: {error!r}", "internal_error")


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
        aborter = asyncio.get_running_loop().call_later(self.grace_s, self.engine.abort_all)
        try:
            await super().shutdown(sockets)
        finally:
            aborter.cancel()


def run_server(engine_args: EngineArgs, server_args: ServerArgs) -> None:
    if engine_args.disaggregation_mode == "prefill":  # the bootstrap port listens where the server does
        engine_args = dataclasses.replace(engine_args, disaggregation_bootstrap_host=server_args.host)
    multiprocess = not server_args.disable_frontend_multiprocessing
    engine = AsyncLLM.from_engine_args(engine_args, max_waiting_requests=server_args.max_waiting_requests,
                                       multiprocess=multiprocess, max_unread_outputs=server_args.max_unread_outputs)
    model_name = server_args.served_model_name or engine.info.model_name
    metrics = EngineMetrics(model_name)
    engine.observers.append(metrics.observe)
    trace = StepTraceWriter(server_args.trace_steps) if server_args.trace_steps else None
    if trace is not None:
        engine.observers.append(trace.observe)
    app = build_app(engine, metrics, model_name, server_args, engine_args)
    config = uvicorn.Config(
        app, host=server_args.host, port=server_args.port, log_level=server_args.log_level,
        timeout_graceful_shutdown=server_args.shutdown_timeout + SHUTDOWN_BACKSTOP_S,
        access_log=server_args.log_level == "debug", http=header_timeout_protocol(server_args.request_read_timeout),
    )
    server = _GracefulServer(config, engine, server_args.shutdown_timeout)
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
    logger.info("serving %s on http://%s:%d", model_name, server_args.host, server_args.port)
    try:
        server.run()
    finally:
        engine.shutdown()
        if trace is not None:
            trace.close()
    if failed:
        logger.error("server stopped: the engine core died")
        sys.exit(1)
    logger.info("server stopped")

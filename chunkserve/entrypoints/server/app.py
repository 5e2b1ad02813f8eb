"""The HTTP server: routes, error bodies, guards, and the process around them.

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
import dataclasses
import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
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
    OPEN_PATHS,
    ApiKeyMiddleware,
    BodySizeLimitMiddleware,
)
from chunkserve.entrypoints.server.openapi import document_request_bodies
from chunkserve.entrypoints.server.protocol import (
    AbortRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
    error_body,
)
from chunkserve.entrypoints.server.serving import Serving
from chunkserve.entrypoints.server.stats_log import INTERVAL_S as STATS_INTERVAL_S, StatsLogger
from chunkserve.entrypoints.server.tool_parsers import TOOL_PARSERS
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
ADMIN_PATHS = frozenset({"/reset_prefix_cache", "/flush_cache", "/debug/steps", "/debug/check", "/export_request",
                         "/import_request"})
HEALTH_GENERATE_TIMEOUT_S = 20.0
SECRET_ARGS = frozenset({"api_key", "admin_api_key"})


def build_app(engine: AsyncLLM, metrics: EngineMetrics, model_names: list[str], args: ServerArgs,
              engine_args: EngineArgs) -> FastAPI:
    """`model_names`: what requests may name; the first is what responses name."""
    model_name = model_names[0]
    serving = Serving(engine, model_names, args.max_prompts_per_request, args.response_role,
                      args.enable_log_requests, args.max_log_len, args.return_tokens_as_token_ids,
                      args.trust_request_chat_template, metrics=metrics,
                      tool_parser=TOOL_PARSERS[args.tool_call_parser] if args.enable_auto_tool_choice else None,
                      exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        engine.shutdown()  # aborts whatever the graceful-shutdown window left running

    docs = {"docs_url": None, "redoc_url": None, "openapi_url": None} if args.disable_fastapi_docs else {}
    app = FastAPI(title="chunkserve", version=VERSION, lifespan=lifespan, **docs)
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

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        return await serving.tokenize(TokenizeRequest.model_validate_json(await raw.body()))

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        return await serving.detokenize(DetokenizeRequest.model_validate_json(await raw.body()))

    @app.get("/v1/models")
    async def models():
        cards = [{"id": name, "object": "model", "created": 0, "owned_by": "chunkserve", "root": model_name,
                  "max_model_len": engine.info.max_model_len} for name in model_names]
        return {"object": "list", "data": cards}

    @app.get("/health")
    async def health():
        if not engine.is_running:
            raise EngineDeadError("the engine is not running")
        return {}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        """SageMaker's health check (vLLM serves it): /health's answer."""
        return await health()

    @app.get("/load")
    async def load():
        """Requests in flight (vLLM's server load): what a load balancer spreads by."""
        return {"server_load": engine.num_requests_in_flight}

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

    # ----- SGLang's native endpoints ------------------------------------------------------------

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        """SGLang's name for /reset_prefix_cache (an admin endpoint here too)."""
        return await reset_prefix_cache()

    @app.get("/get_model_info")
    async def get_model_info():
        return {"model_path": engine_args.model or engine.info.model_name,
                "tokenizer_path": engine_args.tokenizer or engine_args.model or engine.info.model_name,
                "is_generation": True, "served_model_names": model_names}

    @app.get("/get_server_info")
    async def get_server_info():
        """The launch settings (keys left out) and the engine's limits, as SGLang's endpoint."""
        settings = {**dataclasses.asdict(engine_args), **dataclasses.asdict(args)}
        return {**{k: v for k, v in settings.items() if k not in SECRET_ARGS}, "version": VERSION,
                "max_model_len": engine.info.max_model_len, "cpu_threads": engine.info.cpu_threads}

    @app.post("/abort_request")
    async def abort_request(raw: Request):
        """SGLang's: abort the request with this rid (/generate's rid), or every request with abort_all."""
        body = AbortRequest.model_validate_json(await raw.body())
        if body.abort_all:
            engine.abort_all()
        elif body.rid:
            engine.abort(body.rid)
        else:
            raise InvalidRequestError("give rid (a request id) or abort_all: true", "rid")
        return {}

    @app.get("/health_generate")
    async def health_generate():
        """SGLang's deep health check: the engine generates one token within a time limit."""
        return await serving.health_generate(HEALTH_GENERATE_TIMEOUT_S)

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
    app.add_middleware(  # checked before the body is read
        ApiKeyMiddleware,
        api_key=args.api_key or os.environ.get("CHUNKSERVE_API_KEY") or os.environ.get("VLLM_API_KEY") or None,
        admin_api_key=args.admin_api_key or os.environ.get("CHUNKSERVE_ADMIN_API_KEY") or None,
        admin_paths=ADMIN_PATHS, open_paths=OPEN_PATHS - {"/metrics"} if args.protect_metrics else OPEN_PATHS)
    app.add_middleware(  # outermost: a browser's preflight (OPTIONS, no credentials) is answered here
        CORSMiddleware, allow_origins=args.allowed_origins, allow_methods=args.allowed_methods,
        allow_headers=args.allowed_headers, allow_credentials=args.allow_credentials)
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


def bind_socket(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound now: a port in use is an error before the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise InvalidRequestError(f"cannot listen on {host}:{port}: {error.strerror} (is another server running "
                                  f"there? choose another --port)") from None
    return sock


def run_server(engine_args: EngineArgs, server_args: ServerArgs) -> None:
    if engine_args.disaggregation_mode == "prefill":  # the bootstrap port listens where the server does
        engine_args = dataclasses.replace(engine_args, disaggregation_bootstrap_host=server_args.host)
    listener = bind_socket(server_args.host, server_args.port)
    multiprocess = not server_args.disable_frontend_multiprocessing
    try:
        engine = AsyncLLM.from_engine_args(engine_args, max_waiting_requests=server_args.max_waiting_requests,
                                           multiprocess=multiprocess, max_unread_outputs=server_args.max_unread_outputs)
    except BaseException:
        listener.close()
        raise
    model_names = server_args.served_model_name or [engine.info.model_name]
    metrics = EngineMetrics(model_names[0], max_model_len=engine.info.max_model_len, engine_args=engine_args)
    engine.observers.append(metrics.observe)
    if not server_args.disable_log_stats:
        engine.observers.append(StatsLogger(float(os.environ.get("CHUNKSERVE_LOG_STATS_INTERVAL", STATS_INTERVAL_S))
                                            ).observe)
    trace = StepTraceWriter(server_args.trace_steps) if server_args.trace_steps else None
    if trace is not None:
        engine.observers.append(trace.observe)
    app = build_app(engine, metrics, model_names, server_args, engine_args)
    uvicorn_level = server_args.uvicorn_log_level or server_args.log_level
    config = uvicorn.Config(
        app, log_level=uvicorn_level, root_path=server_args.root_path or "",
        timeout_graceful_shutdown=server_args.shutdown_timeout + SHUTDOWN_BACKSTOP_S,
        access_log=uvicorn_level in ("debug", "trace") and not server_args.disable_uvicorn_access_log,
        http=header_timeout_protocol(server_args.request_read_timeout), ssl_keyfile=server_args.ssl_keyfile,
        ssl_certfile=server_args.ssl_certfile, ssl_ca_certs=server_args.ssl_ca_certs,
        ssl_cert_reqs=server_args.ssl_cert_reqs,
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

"""chunkserve replicas on Ray Serve: Serve places the replicas on the cluster's nodes, restarts
a dead one, and routes each request with a request router (Ray Serve LLM's
`PrefixCacheAffinityRouter` by default: a conversation's next turn goes where its history is cached).

Two deployments, as Ray Serve LLM's own `build_openai_app` makes: an ingress that reads each
request's prompt or messages (what the router matches prefixes on) and `ChunkserveServer`, the
replicas. Each replica hosts chunkserve's in-process `AsyncLLM` and answers through chunkserve's
own HTTP app (server/app.py), called in-process: the OpenAI, SGLang and vLLM routes, their errors
and their streams are the standalone server's, byte for byte.

Ray Serve LLM's own builder (`ray.serve.llm.build_openai_app` with `LLMConfig(server_cls=...)`)
is not used: its ingress imports vLLM's (or SGLang's) request models, so it cannot run without
one of those engines installed. The router is independent of them.
"""

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from typing import Any

try:
    import ray
    from ray import serve
    from ray.exceptions import RayError
    from ray.serve.config import RequestRouterConfig
    from ray.serve.deployment import Application
    from ray.serve.handle import DeploymentHandle
except ImportError as error:  # an optional extra
    raise ImportError("chunkserve on Ray Serve needs ray[serve]: pip install 'chunkserve[fleet]'") from error

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from chunkserve.config.engine import EngineArgs
from chunkserve.engine.async_llm import AsyncLLM
from chunkserve.entrypoints.args import ServerArgs
from chunkserve.entrypoints.server.app import build_app
from chunkserve.entrypoints.server.metrics import EngineMetrics
from chunkserve.entrypoints.server.protocol import error_body
from chunkserve.entrypoints.server.serving import error_response, sse
from chunkserve.errors import InvalidRequestError

PREFIX_CACHE_AFFINITY_ROUTER = ("ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router:"
                                "PrefixCacheAffinityRouter")
ROUTERS = {"prefix_cache_affinity": PREFIX_CACHE_AFFINITY_ROUTER, "power_of_two": None}
PROMPT_ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate")
REPLICA_HEADER = "x-chunkserve-replica"  # which replica answered: Serve's replica id (its actor's name ends in it)
# Serve's default (5 a replica) would queue requests in Serve that the engine batches; as Ray Serve LLM
# does, leave queueing to the engine (--max-waiting-requests answers 503 past its limit).
MAX_ONGOING_REQUESTS = 1_000_000_000
HOP_BY_HOP = frozenset({"content-length", "transfer-encoding", "connection"})


@dataclasses.dataclass(frozen=True)
class ForwardedRequest:
    """An HTTP request the ingress hands a replica. `prompt` is what Ray's prefix-affinity
    router matches on (it reads a `messages` or `prompt` attribute of the call's arguments)."""

    method: str
    path: str
    query: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    prompt: Any = ""


@dataclasses.dataclass(frozen=True)
class ForwardedChat(ForwardedRequest):
    """A chat request: the router matches on its messages (their contents, in order)."""

    messages: list[Any] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class ResponseStart:
    """A replica's first answer to a forwarded request; its body's bytes follow."""

    status: int
    headers: list[tuple[str, str]]


@dataclasses.dataclass(frozen=True)
class ResponseEnd:
    """The last item of a replica's answer: the app sent its whole body. An answer that stops
    without it was cut (its replica died)."""


def forwarded_request(method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                      body: bytes) -> ForwardedRequest:
    """The request, with its prompt or messages read for the router (a body that is not JSON
    routes with an empty prompt; the replica then answers its 400)."""
    try:
        fields = json.loads(body) if path in PROMPT_ROUTES and body else {}
    except ValueError:
        fields = {}
    fields = fields if isinstance(fields, dict) else {}
    messages = fields.get("messages")
    if isinstance(messages, list) and any(isinstance(m, dict) and m.get("content") for m in messages):
        return ForwardedChat(method, path, query, headers, body, messages=messages)
    prompt = fields.get("prompt", fields.get("text"))
    # never empty: Ray 2.60's router divides by the text's length (and the request then hangs)
    return ForwardedRequest(method, path, query, headers, body, prompt if isinstance(prompt, (str, list)) and prompt
                            else path)


def engine_args_from(engine_kwargs: dict[str, Any]) -> EngineArgs:
    """EngineArgs from a deployment's `engine_kwargs` (chunkserve's flag names, underscored)."""
    known = {f.name for f in dataclasses.fields(EngineArgs)}
    unknown = sorted(set(engine_kwargs) - known)
    if unknown:
        raise InvalidRequestError(f"engine_kwargs: unknown {', '.join(map(repr, unknown))}; the keys are "
                                  f"EngineArgs' fields, the flags of `chunkserve serve` (e.g. max_num_batched_tokens)",
                                  "engine_kwargs")
    return EngineArgs(**engine_kwargs)


class ChunkserveServer:
    """One replica: chunkserve's engine and HTTP app in the replica's process. Its methods are
    those of Ray Serve LLM's servers (check_health, reset_prefix_cache, record_routing_stats)."""

    def __init__(self, engine_kwargs: dict[str, Any], served_model_name: list[str] | None = None) -> None:
        """`engine_kwargs`: EngineArgs' fields. The engine core runs on a thread of the replica:
        when Serve kills the replica, nothing of it outlives it."""
        self.engine_args = engine_args_from(engine_kwargs)
        self.engine = AsyncLLM.from_engine_args(self.engine_args, multiprocess=False)
        model_names = served_model_name or [self.engine.info.model_name]
        metrics = EngineMetrics(model_names[0], max_model_len=self.engine.info.max_model_len,
                                engine_args=self.engine_args)
        self.engine.observers.append(metrics.observe)
        self.app = build_app(self.engine, metrics, model_names, ServerArgs(served_model_name=model_names),
                             self.engine_args)
        self.replica_id = serve.get_replica_context().replica_id.unique_id

    async def forward(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes | ResponseEnd]:
        """The app's answer: a ResponseStart (naming this replica), the body's bytes as the app
        sends them, then ResponseEnd."""
        async for item in call_asgi(self.app, request):
            if isinstance(item, ResponseStart):
                item = ResponseStart(item.status, [*item.headers, (REPLICA_HEADER, self.replica_id)])
            yield item

    async def check_health(self) -> None:
        """Serve's health check: a replica whose engine core stopped is replaced."""
        if not self.engine.is_running:
            raise RuntimeError("the chunkserve engine core stopped")

    async def reset_prefix_cache(self) -> None:
        if not await self.engine.reset_prefix_cache():
            raise RuntimeError("the prefix cache can only be reset while no request is running or waiting")

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve's request-router hook, polled by its controller."""
        return self.routing_stats()

    def routing_stats(self) -> dict[str, Any]:
        """What Ray's routers read of a replica: its KV-events endpoints (`kv_event_metadata`,
        for Ray's KV-aware router) when the engine publishes events."""
        metadata = self.kv_event_metadata()
        return {} if metadata is None else {"kv_event_metadata": metadata}

    def kv_event_metadata(self) -> dict[str, Any] | None:
        """Ray's `kv_event_metadata` (vLLM replicas send the same): the events' endpoints as other
        nodes reach them, the block size and the step's token budget."""
        config = self.engine_args.kv_events()
        if config is None or not config.publishes:
            return None
        node_ip = ray.util.get_node_ip_address()
        scheduler = self.engine_args.scheduler_config(self.engine.info.max_model_len)
        return {"endpoint": config.endpoint.replace("*", node_ip),
                "replay_endpoint": config.replay_endpoint and config.replay_endpoint.replace("*", node_ip),
                "block_size": self.engine_args.block_size,
                "max_num_batched_tokens": scheduler.max_num_batched_tokens, "dp_rank": 0}

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()


async def call_asgi(app: Any, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes | ResponseEnd]:
    """One request through an ASGI app in this process, its response as the app sends it. The
    client is there until this generator is closed (then the app sees a disconnect: a stream's
    requests abort, as when an HTTP client hangs up)."""
    sent: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    closed = asyncio.Event()
    body_pending = True

    async def receive() -> dict[str, Any]:
        nonlocal body_pending
        if body_pending:
            body_pending = False
            return {"type": "http.request", "body": request.body, "more_body": False}
        await closed.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
             "scheme": "http", "path": request.path, "raw_path": request.path.encode(), "root_path": "",
             "query_string": request.query, "headers": request.headers, "client": None, "server": None}
    task = asyncio.ensure_future(app(scope, receive, sent.put))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], [(k.decode("latin-1"), v.decode("latin-1"))
                                                        for k, v in message.get("headers", [])])
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body"):
                    yield ResponseEnd()
                    return
    finally:
        closed.set()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _body(chunks: Any, is_stream: bool) -> AsyncIterator[bytes]:
    """A response's body from its replica. If the replica dies part-way (Serve's stream then
    fails, or ends without ResponseEnd), a stream ends with an error event and [DONE] (OpenAI's
    in-band error) and any other body is cut, so that the client sees an error, not a short answer."""
    failure = "its answer stopped part-way"
    try:
        async for chunk in chunks:
            if isinstance(chunk, ResponseEnd):
                return
            yield chunk
    except RayError as error:
        failure = str(error)
    message = f"the replica serving this request failed: {failure}"
    if not is_stream:
        raise RuntimeError(message)
    yield sse(error_body(message, "service_unavailable", 503)).encode()
    yield sse("[DONE]").encode()


ingress_app = FastAPI(title="chunkserve on Ray Serve", docs_url=None, redoc_url=None, openapi_url=None)


@serve.ingress(ingress_app)
class ChunkserveIngress:
    """Serve's HTTP entry: every request goes to a replica chosen by the deployment's router."""

    def __init__(self, server: DeploymentHandle) -> None:
        self.server = server.options(stream=True)

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def forward(self, path: str, raw: Request) -> Response:
        request = forwarded_request(raw.method, "/" + path, raw.url.query.encode(), raw.headers.raw,
                                    await raw.body())
        chunks = self.server.forward.remote(request)
        try:
            start = await chunks.__anext__()
        except RayError as error:
            return error_response(503, f"the replica serving this request failed: {error}", "service_unavailable",
                                  headers={"Retry-After": "1"})
        headers = {k: v for k, v in start.headers if k.lower() not in HOP_BY_HOP}
        is_stream = headers.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(_body(chunks, is_stream), status_code=start.status, headers=headers)


@dataclasses.dataclass(frozen=True)
class ChunkserveAppConfig:
    """build_chunkserve_app's fields (`serve run chunkserve.entrypoints.ray_serve:build_chunkserve_app
    num_replicas=2`, or a dict)."""

    engine_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    served_model_name: list[str] | None = None
    num_replicas: int = 1
    request_router: str = "prefix_cache_affinity"  # or power_of_two (Serve's default)
    max_replicas_per_node: int | None = 1  # one engine per node: each uses every core it is given
    num_cpus_per_replica: float = 1.0
    deployment_options: dict[str, Any] = dataclasses.field(default_factory=dict)  # serve.deployment's own

    @classmethod
    def parse(cls, fields: dict[str, Any]) -> "ChunkserveAppConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise InvalidRequestError(f"build_chunkserve_app: unknown {', '.join(map(repr, unknown))}; "
                                      f"the fields are {', '.join(sorted(known))}")
        config = cls(**fields)
        if config.request_router not in ROUTERS:
            raise InvalidRequestError(f"request_router must be one of {', '.join(ROUTERS)}, got "
                                      f"{config.request_router!r}", "request_router")
        engine_args_from(config.engine_kwargs)  # a wrong key fails here, not in every replica
        return config


def build_chunkserve_app(fields: dict[str, Any] | ChunkserveAppConfig) -> Application:
    """The Serve application: the ingress and `num_replicas` chunkserve replicas (serve.run it)."""
    config = fields if isinstance(fields, ChunkserveAppConfig) else ChunkserveAppConfig.parse(
        {k: _parse_cli_value(v) for k, v in fields.items()})
    router = ROUTERS[config.request_router]
    options: dict[str, Any] = {"num_replicas": int(config.num_replicas), "max_ongoing_requests": MAX_ONGOING_REQUESTS,
                               "ray_actor_options": {"num_cpus": config.num_cpus_per_replica},
                               **({"request_router_config": RequestRouterConfig(request_router_class=router)}
                                  if router else {}),
                               **({"max_replicas_per_node": config.max_replicas_per_node}
                                  if config.max_replicas_per_node else {}),
                               **config.deployment_options}
    server = serve.deployment(ChunkserveServer, name="ChunkserveServer", **options).bind(
        config.engine_kwargs, config.served_model_name)
    ingress = serve.deployment(ChunkserveIngress, name="ChunkserveIngress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=MAX_ONGOING_REQUESTS)
    return ingress.bind(server)


def _parse_cli_value(value: Any) -> Any:
    """`serve run ... key=value` passes strings: a JSON one (a number, a dict) is read as JSON."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value

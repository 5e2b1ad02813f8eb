"""The command line's arguments: `EngineArgs` (config/engine.py) and the server's own
`ServerArgs`, each field a flag (`--max-num-batched-tokens`, `--no-enable-prefix-caching`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from chunkserve.config.fields import arg
from chunkserve.entrypoints.server.tool_parsers import TOOL_PARSERS
from chunkserve.errors import InvalidRequestError


def add_cli_args(args_class: type, parser: argparse.ArgumentParser) -> None:
    """One flag per field of the dataclass `args_class`, with the help text of its `arg` metadata
    (an EngineArgs field of a leaf config's flag carries the leaf field's: config/fields.py `flag_of`).
    Reads the annotations as strings (every config module uses `from __future__ import annotations`)."""
    for f in dataclasses.fields(args_class):
        flag = "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"default": f.default, "help": f.metadata["help"], "dest": f.name}
        if f.type == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = f.metadata.get("type") or {"int": int, "float": float}.get(f.type.split(" |")[0], str)
            for key in ("choices", "nargs"):
                if key in f.metadata:
                    kwargs[key] = f.metadata[key]
        parser.add_argument(flag, *f.metadata.get("aliases", ()), **kwargs)
        for negative in f.metadata.get("negative_aliases", ()):
            parser.add_argument(negative, dest=f.name, action="store_false", default=argparse.SUPPRESS,
                                help=f"the same as --no-{f.name.replace('_', '-')}")


def from_cli_args(args_class: type, namespace: argparse.Namespace) -> Any:
    return args_class(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(args_class)})


@dataclass
class ServerArgs:
    """The HTTP server's own flags (vLLM's names where vLLM has them)."""

    host: str = arg("127.0.0.1", "address to listen on (vLLM listens on every interface by default; 0.0.0.0 "
                                 "does that)")
    port: int = arg(8000, "port to listen on (checked before the model loads)")
    served_model_name: list[str] | None = arg(
        None, "the model names the API answers to; the first is the one responses name (default: the model file or "
              "folder name)", nargs="+"
    )
    api_key: str | None = arg(
        None, "require 'Authorization: Bearer KEY' on every endpoint but /health, /ping, /version and /metrics "
              "(default: $CHUNKSERVE_API_KEY, else $VLLM_API_KEY)"
    )
    protect_metrics: bool = arg(False, "require the API key on /metrics too (open by default, as in vLLM)")
    metrics_compat: list[str] | None = arg(
        None, "vllm and/or sglang: /metrics also exports the load series routers scrape under that engine's names "
              "(vllm: vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc, "
              "vllm:gpu_cache_usage_perc, vllm:cache_config_info, vllm:prefix_cache_queries/hits; sglang: "
              "sglang:num_running_reqs, sglang:num_queue_reqs, sglang:token_usage), so that SMG, vllm-router and "
              "llm-d read this server's load (SMG reads a prefill or decode instance's as SGLang's)",
        choices=("vllm", "sglang"), nargs="+"
    )
    admin_api_key: str | None = arg(
        None, "enables the admin endpoints (/reset_prefix_cache, /debug/steps, /debug/check), which then need "
              "'Authorization: Bearer KEY'; without it they are off (default: $CHUNKSERVE_ADMIN_API_KEY)"
    )
    dashboard_without_auth: bool = arg(
        False, "serve /dashboard's live data (/dashboard/events) without the admin key, for a server only you can "
               "reach (the page itself is always served; by default its data needs --admin-api-key)"
    )
    max_waiting_requests: int | None = arg(None, "answer 503 to new requests while this many are waiting")
    max_request_body_bytes: int = arg(16 * 1024 * 1024, "larger request bodies get 413")
    max_prompts_per_request: int = arg(256, "most prompts in one /v1/completions request")
    max_unread_outputs: int = arg(
        1024, "a streamed request whose client leaves this many outputs unread is aborted (the client stopped "
              "reading; counted in /metrics as chunkserve:requests_aborted_unread)"
    )
    request_read_timeout: float = arg(
        30.0, "seconds a client may take to send a request's headers, and then its whole body, before its "
              "connection is closed (slow-loris)"
    )
    restart_engine_on_failure: bool = arg(
        False, "when the engine core process dies, start a new one (answering 503 with Retry-After meanwhile) "
               "instead of exiting with an error for a supervisor to restart the server"
    )
    shutdown_timeout: float = arg(
        10.0, "on SIGINT/SIGTERM, seconds in-flight requests may take to finish before they are aborted"
    )
    log_level: str = arg("info", "server log level", choices=("debug", "info", "warning", "error"))
    uvicorn_log_level: str | None = arg(
        None, "uvicorn's log level (default: --log-level)", choices=("critical", "error", "warning", "info", "debug",
                                                                     "trace")
    )
    disable_uvicorn_access_log: bool = arg(
        False, "no access log at debug level either (below debug there is none here, unlike vLLM)"
    )
    enable_log_requests: bool = arg(False, "log each request as it arrives: its id, prompts and sampling parameters")
    max_log_len: int | None = arg(None, "with --enable-log-requests, log at most this many prompt characters / ids")
    disable_log_stats: bool = arg(
        False, "no periodic stats line (every 10 s while requests run: prompt and generation throughput, running and "
               "waiting requests, KV cache usage, prefix cache hit rate)"
    )
    allowed_origins: str = arg('["*"]', "CORS: allowed origins, a JSON list (vLLM's default: any)")
    allowed_methods: str = arg('["*"]', "CORS: allowed methods, a JSON list")
    allowed_headers: str = arg('["*"]', "CORS: allowed headers, a JSON list")
    allow_credentials: bool = arg(False, "CORS: allow credentials")
    root_path: str | None = arg(None, "the path prefix a proxy serves this server under (FastAPI's root_path)")
    ssl_keyfile: str | None = arg(None, "serve HTTPS with this private key (with --ssl-certfile)")
    ssl_certfile: str | None = arg(None, "serve HTTPS with this certificate (with --ssl-keyfile)")
    ssl_ca_certs: str | None = arg(None, "CA certificates to verify clients by")
    ssl_cert_reqs: int = arg(0, "whether client certificates are required (Python's ssl.CERT_* value: 0 none, 1 "
                                "optional, 2 required)")
    disable_fastapi_docs: bool = arg(False, "no /docs, /redoc and /openapi.json")
    response_role: str = arg("assistant", "the role of the generated chat message")
    return_tokens_as_token_ids: bool = arg(
        False, "logprobs name tokens 'token_id:N' rather than by their text, which can be ambiguous (a request's "
               "return_tokens_as_token_ids overrides it)"
    )
    trust_request_chat_template: bool = arg(
        False, "let chat and /tokenize requests bring their own chat_template (a Jinja template, which the server "
               "then renders: code from the client); without it such a request gets 400, as in vLLM"
    )
    enable_auto_tool_choice: bool = arg(
        False, "serve tool_choice \"auto\" (the default for a request with tools): calls are read from the model's "
               "text by --tool-call-parser; without it such requests get 400, as in vLLM (\"required\" and a named "
               "function need neither flag: their decoding follows the tools' schema)"
    )
    tool_call_parser: str | None = arg(
        None, "the format the model writes tool calls in, for --enable-auto-tool-choice: hermes (Hermes 2 Pro, "
              "Qwen 2.5 and 3), llama3_json (Llama 3.1 and later; llama4_json is the same), mistral",
        choices=tuple(TOOL_PARSERS)
    )
    exclude_tools_when_tool_choice_none: bool = arg(
        False, "requests with tool_choice \"none\" render the chat template without their tools (by default the "
               "template gets them all the same, as in vLLM)"
    )
    trace_steps: str | None = arg(None, "append one JSON line per engine step to this file")
    headless: bool = arg(
        False, "run only this node's worker ranks (--node-rank 1 or more of --nnodes), no server: they connect to "
               "node 0's engine at --master-addr"
    )
    disable_frontend_multiprocessing: bool = arg(
        False, "run the engine on a thread of the server's process instead of a process of its own "
               "(slower: the server's Python work then stalls the engine's steps on the GIL)"
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidRequestError(f"port must be in [0, 65535], got {self.port}")
        if isinstance(self.served_model_name, str):  # (given in code rather than on the command line)
            self.served_model_name = [self.served_model_name]
        if self.served_model_name is not None and not all(name.strip() for name in self.served_model_name):
            raise InvalidRequestError("served_model_name must not be empty")
        if isinstance(self.metrics_compat, str):  # (given in code or a YAML config rather than on the command line)
            self.metrics_compat = [self.metrics_compat]
        unknown = sorted(set(self.metrics_compat or ()) - {"vllm", "sglang"})
        if unknown:
            raise InvalidRequestError(f"--metrics-compat takes vllm and/or sglang, got {', '.join(unknown)}")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError:
                    raise InvalidRequestError(f"{name} must be a JSON list of strings, e.g. '[\"*\"]', got "
                                              f"{value!r}") from None
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise InvalidRequestError(f"{name} must be a JSON list of strings, got {value!r}")
            setattr(self, name, value)
        if self.enable_auto_tool_choice and self.tool_call_parser not in TOOL_PARSERS:
            raise InvalidRequestError(f"--enable-auto-tool-choice needs --tool-call-parser, one of "
                                      f"{', '.join(TOOL_PARSERS)}; got {self.tool_call_parser!r}")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise InvalidRequestError("ssl_keyfile and ssl_certfile go together")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise InvalidRequestError(f"max_log_len must be non-negative, got {self.max_log_len}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise InvalidRequestError("max_waiting_requests must be non-negative")
        if self.max_request_body_bytes < 1:
            raise InvalidRequestError("max_request_body_bytes must be positive")
        for name in ("max_prompts_per_request", "max_unread_outputs", "request_read_timeout"):
            if getattr(self, name) <= 0:
                raise InvalidRequestError(f"{name} must be positive, got {getattr(self, name)}")

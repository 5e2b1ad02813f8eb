"""The command line's arguments: `EngineArgs` (config/engine.py) and the server's own
`ServerArgs`, each field a flag (`--max-num-batched-tokens`, `--no-enable-prefix-caching`)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from chunkserve.config.engine import arg
from chunkserve.errors import InvalidRequestError


def add_cli_args(args_class: type, parser: argparse.ArgumentParser) -> None:
    """One flag per field of the dataclass `args_class`, with the help text of its `arg` metadata.
    Reads the annotations as strings (every config module uses `from __future__ import annotations`)."""
    for f in dataclasses.fields(args_class):
        flag = "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"default": f.default, "help": f.metadata["help"], "dest": f.name}
        if f.type == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = {"int": int, "float": float}.get(f.type.split(" |")[0], str)
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
        parser.add_argument(flag, *f.metadata.get("aliases", ()), **kwargs)


def from_cli_args(args_class: type, namespace: argparse.Namespace) -> Any:
    return args_class(**{f.name: getattr(namespace, f.name) for f in dataclasses.fields(args_class)})


@dataclass
class ServerArgs:
    """The HTTP server's own flags (vLLM's names where vLLM has them)."""

    host: str = arg("127.0.0.1", "address to listen on")
    port: int = arg(8000, "port to listen on")
    served_model_name: str | None = arg(
        None, "the model name the API answers to (default: the model file or folder name)"
    )
    api_key: str | None = arg(
        None, "require 'Authorization: Bearer KEY' on every endpoint but /health (default: $CHUNKSERVE_API_KEY)"
    )
    admin_api_key: str | None = arg(
        None, "enables the admin endpoints (/reset_prefix_cache, /debug/steps, /debug/check), which then need "
              "'Authorization: Bearer KEY'; without it they are off (default: $CHUNKSERVE_ADMIN_API_KEY)"
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
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise InvalidRequestError("max_waiting_requests must be non-negative")
        if self.max_request_body_bytes < 1:
            raise InvalidRequestError("max_request_body_bytes must be positive")
        for name in ("max_prompts_per_request", "max_unread_outputs", "request_read_timeout"):
            if getattr(self, name) <= 0:
                raise InvalidRequestError(f"{name} must be positive, got {getattr(self, name)}")

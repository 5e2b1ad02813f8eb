"""The router's command line and the checked configuration it becomes.

argparse only collects the strings; `config_from_cli_args` checks them and says what is wrong
in one sentence, so that `chunkserve router` fails before it opens a port.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import httpx

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True)
class UpstreamSpec:
    url: str  # scheme://host:port, no trailing slash
    bootstrap_port: int | None = None  # prefill only; None: read from its /server_info


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[UpstreamSpec, ...]
    decode: tuple[UpstreamSpec, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    health_check_interval: float = 1.0  # seconds between two checks of one instance
    health_failure_threshold: int = 2  # failed checks in a row that make an instance unhealthy
    request_timeout: float = 600.0  # seconds for a whole request, its stream included
    log_level: str = "info"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pd-disaggregation", action="store_true",
                        help="send each request to a prefill and a decode instance at once (required: the only "
                             "mode the router implements)")
    parser.add_argument("--prefill", nargs="+", action="append", default=[], metavar=("URL", "BOOTSTRAP_PORT"),
                        help="a prefill server (`chunkserve serve --disaggregation-mode prefill`) and optionally "
                             "its bootstrap port (default: the one its /server_info reports); repeat for more")
    parser.add_argument("--decode", action="append", default=[], metavar="URL",
                        help="a decode server (`chunkserve serve --disaggregation-mode decode`); repeat for more")
    parser.add_argument("--host", default=RouterConfig.host)
    parser.add_argument("--port", type=int, default=RouterConfig.port)
    parser.add_argument("--health-check-interval", type=float, default=RouterConfig.health_check_interval,
                        help="seconds between two health checks of an instance")
    parser.add_argument("--health-failure-threshold", type=int, default=RouterConfig.health_failure_threshold,
                        help="failed health checks in a row that take an instance out of rotation")
    parser.add_argument("--request-timeout", type=float, default=RouterConfig.request_timeout,
                        help="seconds a request may take, its whole stream included")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default=RouterConfig.log_level)


def config_from_cli_args(args: argparse.Namespace) -> RouterConfig:
    """Raises ValueError naming the flag at fault."""
    if not args.pd_disaggregation:
        raise ValueError("--pd-disaggregation is required: prefill/decode disaggregation is the only mode "
                         "the router implements so far")
    if not args.prefill:
        raise ValueError("no prefill instance: give at least one --prefill URL [BOOTSTRAP_PORT]")
    if not args.decode:
        raise ValueError("no decode instance: give at least one --decode URL")
    prefill = tuple(_prefill_spec(values) for values in args.prefill)
    decode = tuple(UpstreamSpec(_base_url(url, "--decode")) for url in args.decode)
    for flag, specs in (("--prefill", prefill), ("--decode", decode)):
        urls = [spec.url for spec in specs]
        twice = sorted({url for url in urls if urls.count(url) > 1})
        if twice:
            raise ValueError(f"{flag} {twice[0]} is given twice")
    if args.health_check_interval <= 0:
        raise ValueError(f"--health-check-interval must be positive, got {args.health_check_interval}")
    if args.health_failure_threshold < 1:
        raise ValueError(f"--health-failure-threshold must be at least 1, got {args.health_failure_threshold}")
    if args.request_timeout <= 0:
        raise ValueError(f"--request-timeout must be positive, got {args.request_timeout}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    return RouterConfig(prefill, decode, args.host, args.port, args.health_check_interval,
                        args.health_failure_threshold, args.request_timeout, args.log_level)


def _prefill_spec(values: list[str]) -> UpstreamSpec:
    if len(values) > 2:
        raise ValueError(f"--prefill takes a URL and optionally its bootstrap port, got {len(values)} values: "
                         f"{' '.join(values)}")
    url = _base_url(values[0], "--prefill")
    if len(values) == 1:
        return UpstreamSpec(url)
    port = values[1]
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"--prefill {values[0]}: the bootstrap port must be a number in 1..65535, got {port!r}")
    return UpstreamSpec(url, int(port))


def _base_url(text: str, flag: str) -> str:
    """`http://host:port` from what the user typed; a path, query or other scheme is an error."""
    problem = f"{flag} {text!r} is not a server's base URL such as http://10.0.0.2:30000"
    try:
        url = httpx.URL(text)
    except httpx.InvalidURL as error:
        raise ValueError(f"{problem} ({error})") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(problem)
    if url.path not in ("", "/") or url.query or url.fragment or url.userinfo:
        raise ValueError(f"{problem}: give no path, query or credentials")
    return str(url.copy_with(path="/")).rstrip("/")

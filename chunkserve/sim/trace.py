"""What a simulation serves: one `SimRequest` per request, read from a request trace (JSONL) or
converted from a `chunkserve bench` workload, a bench result, or a server's request log.

A trace line is a JSON object:

    {"arrival": 0.25,                 # seconds from the start (or, with "after", after that request ended)
     "prompt_token_ids": [...],       # the prompt, or instead:
     "prompt_len": 300,               #   its length, with optionally
     "prefix_id": "system-a", "prefix_len": 256,   # a prefix shared by every request naming it, and/or
     "session_id": "chat-7",          #   a conversation: the prompt extends the session's previous prompt
     "output_len": 64,                # tokens generated (the request ends there)
     "n": 1, "priority": 0,           # optional
     "kind": "normal",                # optional label, kept in the result (bench's kinds)
     "after": 3}                      # optional: index of an earlier line; arrival counts from its end

Prompts given by length are made of token ids that depend only on the line (and its prefix and
session), so the prefix cache sees exactly the sharing the trace describes. A server's request
log (`--enable-log-requests`) converts too (`from_request_log`).
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from chunkserve.bench.workloads import TOKEN_ID_MARGIN, RequestSpec, build_workload
from chunkserve.errors import InvalidRequestError

SYNTHETIC_VOCAB = 49152  # prompts made from lengths: ids in [TOKEN_ID_MARGIN, SYNTHETIC_VOCAB - TOKEN_ID_MARGIN)


@dataclass(frozen=True)
class SimRequest:
    prompt_token_ids: tuple[int, ...]
    output_len: int
    arrival: float  # seconds from the start, or after request `after` ended
    kind: str = "normal"
    n: int = 1
    priority: int = 0
    after: int | None = None

    def to_json(self) -> dict[str, Any]:
        line = asdict(self)
        line["prompt_token_ids"] = list(self.prompt_token_ids)
        return {key: value for key, value in line.items() if value is not None}


def _tokens(key: str, length: int, vocab_size: int) -> list[int]:
    """`length` token ids that depend only on `key`."""
    rng = np.random.default_rng(zlib.crc32(key.encode()))
    return rng.integers(TOKEN_ID_MARGIN, vocab_size - TOKEN_ID_MARGIN, size=length).tolist()


def _positive_int(line: dict[str, Any], key: str, number: int, default: int | None = None) -> int:
    value = line.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidRequestError(f"trace line {number}: {key} must be an integer >= 1, got {value!r}")
    return value


def request_of_line(line: dict[str, Any], number: int, sessions: dict[str, list[int]],
                    vocab_size: int = SYNTHETIC_VOCAB) -> SimRequest:
    """One trace line as a request (`number` counts from 0; `sessions` holds each session's last prompt)."""
    arrival = line.get("arrival", 0.0)
    if not isinstance(arrival, (int, float)) or arrival < 0:
        raise InvalidRequestError(f"trace line {number}: arrival must be seconds >= 0, got {arrival!r}")
    after = line.get("after")
    if after is not None and not (isinstance(after, int) and 0 <= after < number):
        raise InvalidRequestError(f"trace line {number}: after must name an earlier line (0..{number - 1}), "
                                  f"got {after!r}")
    if "prompt_token_ids" in line:
        prompt = line["prompt_token_ids"]
        if not prompt or not all(isinstance(t, int) and 0 <= t < vocab_size for t in prompt):
            raise InvalidRequestError(f"trace line {number}: prompt_token_ids must be a non-empty list of ids "
                                      f"in [0, {vocab_size})")
    else:
        length = _positive_int(line, "prompt_len", number)
        prompt = []
        if "prefix_id" in line:
            prefix_len = min(_positive_int(line, "prefix_len", number), length)
            prompt = _tokens(f"prefix:{line['prefix_id']}", prefix_len, vocab_size)
        session = line.get("session_id")
        if session is not None and len(sessions.get(session, ())) <= length:
            prompt = list(sessions[session]) if session in sessions else prompt
        prompt = prompt + _tokens(f"line:{number}", length - len(prompt), vocab_size)
        if session is not None:
            sessions[session] = prompt
    return SimRequest(tuple(prompt), _positive_int(line, "output_len", number), float(arrival),
                      str(line.get("kind", "normal")), _positive_int(line, "n", number, 1),
                      int(line.get("priority", 0)), after)


def read_request_trace(path: str, vocab_size: int = SYNTHETIC_VOCAB) -> list[SimRequest]:
    sessions: dict[str, list[int]] = {}
    requests = []
    try:
        with open(path) as f:
            lines = [json.loads(text) for text in f if text.strip()]
    except (OSError, json.JSONDecodeError) as error:
        raise InvalidRequestError(f"request trace {path!r} could not be read: {error}") from None
    for number, line in enumerate(lines):
        if not isinstance(line, dict):
            raise InvalidRequestError(f"trace line {number}: a JSON object is expected")
        requests.append(request_of_line(line, number, sessions, vocab_size))
    if not requests:
        raise InvalidRequestError(f"request trace {path!r} has no requests")
    return requests


def write_request_trace(requests: list[SimRequest], path: str) -> None:
    with open(path, "w") as f:
        for request in requests:
            f.write(json.dumps(request.to_json()) + "\n")


def from_specs(specs: list[RequestSpec]) -> list[SimRequest]:
    """A bench workload's requests (bench/workloads.py) as the simulator takes them."""
    return [SimRequest(tuple(s.prompt_token_ids), s.output_len, s.send_at, s.kind, after=s.after) for s in specs]


def from_workload(args: argparse.Namespace) -> list[SimRequest]:
    """The requests `chunkserve bench serve` would send with these workload flags and seed."""
    return from_specs(build_workload(args, np.random.default_rng(args.seed)))


def from_bench_result(path: str) -> list[SimRequest]:
    """The requests of a `chunkserve bench serve` result file: its recorded config rebuilds the
    exact workload it sent (same prompts, lengths and arrivals)."""
    try:
        with open(path) as f:
            result = json.load(f)
        config = dict(result["config"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
        raise InvalidRequestError(f"bench result {path!r} could not be read: {error}") from None
    if config.get("dataset_name", "random") != "random":
        raise InvalidRequestError(f"bench result {path!r} ran a data set ({config['dataset_name']}); only synthetic "
                                  "workloads can be rebuilt from a result")
    for key, value in config.items():
        if value in ("inf", "-inf", "nan"):
            config[key] = float(value)
    return from_workload(argparse.Namespace(**config))



# `chunkserve serve --enable-log-requests` (entrypoints/server/serving.py): one line per request as it arrives
_LOGGED = re.compile(r"request (?P<id>\S+): arrived (?P<time>[0-9.]+), "
                     r"prompts (?P<prompts>\[.*\]), params (?P<params>.*)$")


def from_request_log(path: str, tokenize: Callable[[str], list[int]] | None = None) -> list[SimRequest]:
    """The requests a server logged with --enable-log-requests (without --max-log-len: a cut
    prompt's length is unknown), arrivals from the first one's. Each runs to its max_tokens,
    since the log cannot say where it stopped; text prompts need `tokenize` (the model's
    tokenizer); a prompt's images are not simulated (its token ids are)."""
    requests: list[SimRequest] = []
    first = None
    try:
        with open(path, errors="replace") as f:
            lines = [(number, _LOGGED.search(text)) for number, text in enumerate(f, 1)]
    except OSError as error:
        raise InvalidRequestError(f"request log {path!r} could not be read: {error}") from None
    for number, found in lines:
        if found is None:
            continue
        where = f"{path}:{number}"
        max_tokens = re.search(r"\bmax_tokens=(\d+)", found["params"])
        if max_tokens is None:
            raise InvalidRequestError(f"{where}: the request has no max_tokens, so its output length is unknown")
        n = re.search(r"\bn=(\d+)", found["params"])
        arrival = float(found["time"])
        first = arrival if first is None else first
        for prompt in ast.literal_eval(found["prompts"]):
            if isinstance(prompt, dict):
                prompt = prompt["token_ids"]
            if isinstance(prompt, str):
                if tokenize is None:
                    raise InvalidRequestError(f"{where}: a text prompt needs the model's tokenizer")
                prompt = tokenize(prompt)
            requests.append(SimRequest(tuple(prompt), int(max_tokens[1]), arrival - first, n=int(n[1]) if n else 1))
    if not requests:
        raise InvalidRequestError(f"request log {path!r} has no request lines (serve with --enable-log-requests)")
    return requests

"""A schema fuzzer for the request bodies of POST /v1/completions, /v1/chat/completions and
/generate, against one real server on a tiny random-weight model.

Each field gets a valid value most of the time and a hostile one otherwise: NaN, Infinity
and 1e400 as raw JSON tokens, integers past 64 bits, negatives, bools and floats where
integers go, strings where numbers go, empty, long and nested lists, unknown and duplicate
keys, lone surrogates; the body text itself is sometimes mangled (truncated, invalid UTF-8,
nested thousands deep, not an object). The bodies are written by hand rather than with
json.dumps, so any token can be sent as is.

Properties:
- no response is a 5xx, and no stream carries an in-band error event;
- every non-2xx answer has OpenAI's error shape ({"error": {message, type, param, code}});
- every 50 cases and after each test, an ordinary request succeeds and /health is 200;
- a value of the wrong JSON type, or a non-finite number, in a typed field gets 400 naming
  that field (not coerced: "4" and 4.0 and true are not integers);
- the hostile requests of the issue do not disturb a bystander stream that runs meanwhile.

The random part (1,300 hypothesis cases under `-m slow`, an eighth of them in the default tier)
finds crashes in odd combinations; a value that breaks only one field is rare among them, so two
grids send each hostile number to each numeric field and each wrong type to each typed field
(about 1,800 requests, not random, in both tiers). hypothesis runs derandomized (the same cases
on every run, no example database). FUZZ_EXAMPLES=2 doubles the random cases, 0.1 cuts them to
a tenth.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.hostile_server import (
    auth,
    error_shape_problem,
    server_log_tail,
    sse_events,
    start_tiny_server,
    stream_error_events,
)
from tests.server_process import stop_server

VOCAB = 49152  # the default tokenizer's, which the tiny model uses
SCALE = float(os.environ.get("FUZZ_EXAMPLES", "1"))
SANITY_EVERY = 50


# ----- writing JSON by hand ----------------------------------------------------------------------


class Raw(str):
    """JSON text sent as is (NaN, 1e400, a lone surrogate escape, a thousand brackets)."""


class Pairs(list):
    """A JSON object as (key, value) pairs: keys may repeat."""


ABSENT = Raw("<absent>")  # a field left out of its object


def dump(value: Any) -> str:
    if isinstance(value, Raw):
        return str(value)
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # ensure_ascii: a lone surrogate goes out as its \\uXXXX escape
    if isinstance(value, Pairs):
        return "{" + ",".join(f"{dump(k)}:{dump(v)}" for k, v in value if v is not ABSENT) + "}"
    if isinstance(value, dict):
        return dump(Pairs(value.items()))
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(dump(v) for v in value) + "]"
    raise TypeError(type(value))


# ----- hostile values ----------------------------------------------------------------------------

NON_FINITE = [Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e400"), Raw("-1e400"), Raw("nan"), Raw("inf")]
ODD_NUMBERS = [Raw("1e-45"), Raw("-0.0"), Raw("-0"), Raw("1E2"), Raw("0.5e1"), Raw("4.0"), Raw("1e308"),
               Raw("5e-324"), Raw("0.0"), Raw("1" + "0" * 400), Raw("-" + "9" * 30)]
HUGE_INTS = [2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**64 + 1, -(2**63), -(2**63) - 1, 10**30, -1,
             -100, 0, -(2**31)]
NUMBER_STRINGS = ["4", "1.5", "1e3", "NaN", "Infinity", " 1", "0x10", "", "true", "null", "٣"]
DEEP = [Raw("[" * 300 + "]" * 300), Raw('{"a":' * 300 + "1" + "}" * 300), Raw("[" * 5000 + "]" * 5000)]
ODD_STRINGS = [Raw('"\\ud800"'), Raw('"\\udfff\\ud800x"'), Raw('"a\\u0000b"'), Raw('"\\uffff"'), "\u202e\u0000",
               "x" * 100_000, "<|im_start|>system\n", "<|endoftext|>" * 20, "😀" * 50, "\n" * 300]

scalars = st.one_of(st.booleans(), st.none(), st.integers(-(2**70), 2**70), st.floats(),
                    st.text(max_size=12), st.sampled_from(NON_FINITE + ODD_NUMBERS))
junk = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                    st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                    max_leaves=12)

HOSTILE_KINDS = [  # (weight, strategy): number-shaped trouble first, since most fields are numbers
    (16, st.sampled_from(NON_FINITE)),
    (10, st.sampled_from(ODD_NUMBERS)),
    (14, st.sampled_from(HUGE_INTS)),
    (6, st.booleans()),
    (4, st.none()),
    (4, st.just(ABSENT)),
    (4, st.floats()),
    (8, st.sampled_from(NUMBER_STRINGS)),
    (4, st.text(max_size=30)),
    (5, st.sampled_from(ODD_STRINGS)),
    (3, st.sampled_from(DEEP)),
    (8, st.sampled_from([[], {}, [[]], [None], [True, False], [1.0, 2.0], ["a"], [[1, 2], "a"]])),
    (2, st.sampled_from([[0] * 30_000, ["a"] * 300, [[1]] * 300, list(range(VOCAB - 5, VOCAB + 5))])),
    (12, junk),
]
_HOSTILE_TABLE = [strategy for weight, strategy in HOSTILE_KINDS for _ in range(weight)]
hostile = st.integers(0, len(_HOSTILE_TABLE) - 1).flatmap(lambda i: _HOSTILE_TABLE[i])
hostile_number = st.one_of(st.sampled_from(NON_FINITE), st.sampled_from(ODD_NUMBERS), st.sampled_from(HUGE_INTS),
                           st.floats(), hostile)  # for a numeric field
NUMERIC_FIELDS = {"temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "priority", "n", "max_tokens", "logprobs",
                  "max_completion_tokens", "top_logprobs", "max_new_tokens", "min_new_tokens", "sampling_seed"}


def mostly(valid: st.SearchStrategy, valid_weight: int = 7) -> st.SearchStrategy:
    """`valid` about valid_weight times in 10, else a hostile value."""
    return st.integers(0, 9).flatmap(lambda k: valid if k < valid_weight else hostile)


# ----- valid values ------------------------------------------------------------------------------

short_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40)
token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=24)
small_max_tokens = st.integers(1, 8)
stop = st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=3))

SAMPLING = {  # the fields _OpenAISampling shares, each with a valid strategy
    "temperature": st.one_of(st.just(0), st.floats(0, 2)),
    "top_p": st.floats(0.01, 1),
    "top_k": st.sampled_from([-1, 0, 1, 5, 50]),
    "min_p": st.floats(0, 1),
    "seed": st.integers(0, 2**32),
    "stop": stop,
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=4),
    "ignore_eos": st.booleans(),
    "min_tokens": st.integers(0, 1),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "skip_special_tokens": st.booleans(),
    "priority": st.integers(-5, 5),
    "n": st.just(1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "cache_salt": st.text(max_size=16),
    "user": st.text(max_size=8),
}
prompt = st.one_of(short_text, token_ids, st.lists(short_text, min_size=1, max_size=3),
                   st.lists(token_ids, min_size=1, max_size=3))
message = st.fixed_dictionaries({
    "role": mostly(st.sampled_from(["user", "system", "assistant", "developer"]), 8),
    "content": mostly(st.one_of(short_text, st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                            "text": short_text}),
                                                     min_size=1, max_size=2)), 8),
})
unknown_fields = st.dictionaries(st.text(min_size=1, max_size=10), junk, max_size=2)


def body(required: dict[str, st.SearchStrategy], optional: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """A body: the required fields and about a third of the optional ones, all valid but for a
    few (none in 3 bodies of 10, one in 4, two or more in the rest), sometimes unknown fields
    and a field repeated with another value. Few hostile fields per body, so that a bad value
    is not hidden behind another field's 400 and reaches the engine when validation lets it."""

    @st.composite
    def build(draw) -> Pairs:
        present = [*required, *(k for k in optional if draw(st.integers(0, 9)) < 3)]
        num_hostile = draw(st.sampled_from([0, 0, 0, 1, 1, 1, 1, 2, 2, 4]))
        bad = set(draw(st.lists(st.sampled_from(present), max_size=num_hostile, unique=True))) if present else set()
        pairs = Pairs()
        if draw(st.integers(0, 9)) == 0:
            pairs.extend(draw(unknown_fields).items())
        for key in present:
            if key in bad:
                pairs.append((key, draw(hostile_number if key in NUMERIC_FIELDS else hostile)))
            else:
                pairs.append((key, draw({**optional, **required}[key])))
        if draw(st.integers(0, 19)) == 0:
            pairs.append((draw(st.sampled_from(present)), draw(hostile)))
        return pairs

    return build()


completion_body = body({"prompt": prompt, "max_tokens": small_max_tokens},
                       {**SAMPLING, "model": st.just("tiny"), "logprobs": st.integers(0, 5), "echo": st.booleans(),
                        "suffix": st.text(max_size=4)})
chat_body = body({"messages": st.lists(message, min_size=1, max_size=3), "max_tokens": small_max_tokens},
                 {**SAMPLING, "max_completion_tokens": small_max_tokens, "logprobs": st.booleans(),
                  "top_logprobs": st.integers(0, 20), "add_generation_prompt": st.booleans(),
                  "tools": st.just([]), "response_format": st.just({"type": "text"})})
generate_sampling = body({"max_new_tokens": small_max_tokens}, {
    "temperature": SAMPLING["temperature"], "top_p": SAMPLING["top_p"], "top_k": SAMPLING["top_k"],
    "min_p": SAMPLING["min_p"], "stop": stop, "stop_token_ids": SAMPLING["stop_token_ids"],
    "ignore_eos": st.booleans(), "min_new_tokens": st.integers(0, 1),
    "presence_penalty": SAMPLING["presence_penalty"], "frequency_penalty": SAMPLING["frequency_penalty"],
    "repetition_penalty": SAMPLING["repetition_penalty"], "skip_special_tokens": st.booleans(),
    "sampling_seed": st.integers(0, 2**32),
})
generate_body = st.one_of(
    body({"text": short_text, "sampling_params": generate_sampling},
         {"stream": st.booleans(), "rid": st.uuids().map(str), "input_ids": token_ids}),
    body({"input_ids": token_ids, "sampling_params": generate_sampling},
         {"stream": st.booleans(), "rid": st.uuids().map(str), "text": short_text}),
)


def mangle(text: str) -> st.SearchStrategy[bytes]:
    """The body's bytes, now and then broken as text or as JSON."""
    raw = text.encode("utf-8", "surrogatepass")
    return st.one_of(
        st.just(raw), st.just(raw), st.just(raw), st.just(raw), st.just(raw), st.just(raw),
        st.integers(0, max(0, len(raw) - 1)).map(lambda n: raw[:n]),  # truncated
        st.integers(0, len(raw)).map(lambda n: raw[:n] + b"\xff\xfe\xc3" + raw[n:]),  # invalid UTF-8
        st.just(raw + b" trailing"),
        st.just(b"\xef\xbb\xbf" + raw),  # a byte-order mark
        st.sampled_from([b"", b"null", b"[]", b"42", b'"text"', b"[" * 100_000, b"{" * 100_000,
                         b'{"prompt": "a", "max_tokens": 2' + b"}" * 10]),
    )


# ----- the server and the checks ---------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = start_tiny_server(tmp_path_factory, "--max-num-seqs", "8", "--num-kv-blocks", "64",
                                "--max-num-batched-tokens", "128", name="fuzz-server")
    yield started
    stop_server(started)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers=auth(), timeout=60) as client:
        yield client


class Sanity:
    """An ordinary request and /health, every SANITY_EVERY cases."""

    def __init__(self, server, http: httpx.Client) -> None:
        self.server, self.http, self.cases = server, http, 0

    def after_case(self) -> None:
        self.cases += 1
        if self.cases % SANITY_EVERY == 0:
            self.check()

    def check(self) -> None:
        assert self.server.process.poll() is None, f"the server exited:\n{server_log_tail(self.server)}"
        health = httpx.get(f"{self.server.base_url}/health", timeout=30)
        assert health.status_code == 200, f"/health answered {health.status_code}: {health.text}"
        normal = self.http.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 3, "temperature": 0})
        assert normal.status_code == 200, f"an ordinary request got {normal.status_code}: {normal.text[:300]}"
        assert normal.json()["choices"][0]["finish_reason"] in ("length", "stop"), normal.text[:300]


@pytest.fixture(scope="module")
def sanity(server, http):
    return Sanity(server, http)


def send(http: httpx.Client, path: str, content: bytes) -> tuple[int, bytes, bool]:
    """POST and read the whole answer: (status, body, whether it was an event stream). A
    connection the server dropped while idle (it closes keep-alive connections after a 500)
    is retried once on a fresh one; a second failure is the request's own."""
    for attempt in range(2):
        try:
            with http.stream("POST", path, content=content, headers={"Content-Type": "application/json"}) as response:
                data = response.read()
                streamed = response.headers.get("content-type", "").startswith("text/event-stream")
                return response.status_code, data, streamed
        except (httpx.ReadError, httpx.RemoteProtocolError, httpx.WriteError):
            if attempt:
                raise
    raise AssertionError("unreachable")


def check_response(path: str, content: bytes, status: int, data: bytes, streamed: bool) -> None:
    shown = content[:300]
    assert status < 500, f"{path} answered {status} to {shown!r}: {data[:500]!r}"
    if not 200 <= status < 300:
        problem = error_shape_problem(status, data)
        assert problem is None, f"{path} answered {status} to {shown!r} with {problem}"
        return
    if streamed:
        events = sse_events(data.decode("utf-8", "replace"))
        errors = stream_error_events(events)
        assert not errors, f"{path} streamed error events for {shown!r}: {errors}"
        assert events and events[-1] == "[DONE]", f"{path}: the stream for {shown!r} did not end with [DONE]"
    else:
        json.loads(data)  # a 2xx body is JSON


STATUSES: Counter = Counter()  # (path, status) of the random cases, printed at the end (pytest -s)


def fuzz_one(http: httpx.Client, sanity: Sanity, path: str, content: bytes) -> None:
    status, data, streamed = send(http, path, content)
    STATUSES[path, status] += 1
    check_response(path, content, status, data, streamed)
    sanity.after_case()


# ----- the fuzz tests ----------------------------------------------------------------------------


# The default tier runs an eighth of the random cases (the grids and the bystander cases below
# stay whole); `-m slow` runs them all.
FUZZ_SHARES = [pytest.param(0.125, id="eighth"), pytest.param(1.0, id="all", marks=pytest.mark.slow)]


def run_hypothesis(examples: int, share: float, check, **strategies) -> None:
    """Run `check` on `share` of `examples` hypothesis cases drawn from `strategies`."""
    settings(max_examples=max(1, int(examples * share * SCALE)), deadline=None, derandomize=True, database=None,
             suppress_health_check=list(HealthCheck), print_blob=False)(given(**strategies)(check))()


# each endpoint's body strategy and its number of random cases (before the share)
ENDPOINT_CASES = {"/v1/completions": (completion_body, 500), "/v1/chat/completions": (chat_body, 400),
                  "/generate": (generate_body, 300)}


@pytest.mark.parametrize("share", FUZZ_SHARES)
@pytest.mark.parametrize("path", list(ENDPOINT_CASES))
def test_fuzz_each_endpoint(http, sanity, path, share):
    body, examples = ENDPOINT_CASES[path]

    def check(data):
        fuzz_one(http, sanity, path, data.draw(mangle(dump(data.draw(body)))))

    run_hypothesis(examples, share, check, data=st.data())


@pytest.mark.parametrize("share", FUZZ_SHARES)
def test_fuzz_whole_body_junk(http, sanity, share):
    def check(path, value):
        fuzz_one(http, sanity, path, dump(value).encode("utf-8", "surrogatepass"))

    run_hypothesis(100, share, check, path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/generate"]),
                   value=junk)


GRID_FIELDS = {
    "/v1/completions": ["temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "presence_penalty",
                        "frequency_penalty", "repetition_penalty", "priority", "n", "max_tokens", "logprobs"],
    "/v1/chat/completions": ["temperature", "top_p", "top_k", "min_p", "seed", "min_tokens", "presence_penalty",
                             "frequency_penalty", "repetition_penalty", "priority", "n", "max_tokens",
                             "max_completion_tokens", "top_logprobs"],
    "/generate": ["max_new_tokens", "temperature", "top_p", "top_k", "min_p", "min_new_tokens", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "sampling_seed"],
}
GRID_VALUES = [*NON_FINITE, *ODD_NUMBERS, *HUGE_INTS, True, False, None, "4", "NaN", [], {}]
GRID_CLIENTS = 8  # concurrent requests of the grid
GRID_BASES = {
    "/v1/completions": {"prompt": "Hello", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True},
    "/generate": {"text": "Hello", "sampling_params": {"max_new_tokens": 2}},
}


def test_every_numeric_field_with_every_hostile_number(http, sanity):
    """Not random: each numeric field of each endpoint, alone in an otherwise valid body, gets
    each hostile number (about 1,400 requests, GRID_CLIENTS at a time: the valid ones are
    batched by the engine as a client's would be). No 5xx, OpenAI's error shape on every refusal."""
    cases = []
    for path, fields in GRID_FIELDS.items():
        for field in fields:
            for value in GRID_VALUES:
                body = json.loads(json.dumps(GRID_BASES[path]))
                (body["sampling_params"] if path == "/generate" else body)[field] = value
                cases.append((path, dump(body).encode()))

    def failure_of(path: str, content: bytes) -> str | None:
        try:
            status, data, streamed = send(http, path, content)
            check_response(path, content, status, data, streamed)
        except AssertionError as error:
            return str(error).split("\n")[0]
        except httpx.TransportError as error:
            return f"{path} {content!r}: the connection failed: {error!r}"
        return None

    with ThreadPoolExecutor(GRID_CLIENTS) as pool:
        failures = [f for f in pool.map(lambda case: failure_of(*case), cases) if f is not None]
    sanity.check()
    assert not failures, f"{len(failures)} hostile numbers broke a request:\n" + "\n".join(failures[:40])


def test_the_server_is_still_sane_after_the_fuzzing(sanity):
    print(f"\nrandom cases by (path, status): {dict(sorted(STATUSES.items()))}")
    sanity.check()


# ----- wrong types and non-finite numbers are refused, naming the field -------------------------

INT_FIELDS = {"max_tokens", "top_k", "seed", "min_tokens", "priority", "logprobs", "top_logprobs",
              "max_completion_tokens", "max_new_tokens", "min_new_tokens", "sampling_seed", "n"}
FLOAT_FIELDS = {"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"}
NOT_AN_INT = [Raw("4.0"), Raw("1.5"), "4", True, Raw("NaN"), Raw("Infinity"), Raw("1e400"), [], {}, [4]]
NOT_A_FLOAT = [Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e400"), Raw("-1e400"), "0.5", True, [], {}]
NOT_TOKEN_IDS = [[True, False], [1.0, 2.0], ["1", "2"], [Raw("NaN")], [None], [Raw("1e400")], [1, Raw("2.5")]]

BASES = {
    "/v1/completions": {"prompt": "Hello", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True},
    "/generate": {"text": "Hello", "sampling_params": {"max_new_tokens": 2}},
}
TOP_LEVEL = {
    "/v1/completions": sorted({"max_tokens", "top_k", "seed", "min_tokens", "priority", "logprobs", "n"}
                              | FLOAT_FIELDS) + ["prompt", "stop_token_ids"],
    "/v1/chat/completions": sorted({"max_tokens", "top_k", "seed", "min_tokens", "priority", "top_logprobs",
                                    "max_completion_tokens", "n"} | FLOAT_FIELDS) + ["stop_token_ids"],
    "/generate": ["input_ids"],
}
NESTED = sorted({"max_new_tokens", "min_new_tokens", "sampling_seed", "top_k"} | FLOAT_FIELDS) + ["stop_token_ids"]


OUT_OF_RANGE = [  # (path, field, value): refused, and the error must name the field the client sent
    ("/v1/chat/completions", "top_logprobs", 21),
    ("/v1/chat/completions", "top_logprobs", -1),
    ("/v1/chat/completions", "max_completion_tokens", 0),
    ("/v1/chat/completions", "max_completion_tokens", 10**6),
    ("/generate", "max_new_tokens", 0),
    ("/generate", "max_new_tokens", 10**6),
    ("/generate", "min_new_tokens", -1),
    ("/generate", "sampling_seed", 2**70),
]


def wrong_value_cases() -> list[tuple[str, str, Any]]:
    """(path, field, value): every typed field of every endpoint with every value of the wrong
    type or not finite, then the out-of-range values whose error names the field."""
    cases = []
    for path in BASES:
        for field in TOP_LEVEL[path] + (NESTED if path == "/generate" else []):
            if field in ("prompt", "input_ids", "stop_token_ids"):  # a list of strings is a valid prompt
                values = [v for v in NOT_TOKEN_IDS if field != "prompt" or not all(isinstance(t, str) for t in v)]
            else:
                values = NOT_AN_INT if field in INT_FIELDS else NOT_A_FLOAT
            cases.extend((path, field, value) for value in values)
    return cases + OUT_OF_RANGE


def test_wrong_types_and_non_finite_numbers_get_400_naming_the_field(http, sanity):
    """Not random: about 400 requests (GRID_CLIENTS at a time), each a valid body but for one
    field. A string, a bool or a float where an integer goes, NaN or Infinity or 1e400 anywhere,
    is refused with 400 (not coerced), and the error's param is the field the client sent."""
    cases = wrong_value_cases()
    with ThreadPoolExecutor(GRID_CLIENTS) as pool:
        failures = [f for f in pool.map(lambda case: wrong_value_failure(http, *case), cases) if f is not None]
    sanity.check()
    assert not failures, f"{len(failures)} of {len(cases)} bad values were not refused " \
                         f"as they should be:\n" + "\n".join(failures[:60])


def wrong_value_failure(http: httpx.Client, path: str, field: str, value: Any) -> str | None:
    """What is wrong with the answer to the body of `path` with `field` set to `value`, if anything."""
    body = json.loads(json.dumps(BASES[path]))
    nested = path == "/generate" and field != "input_ids"
    if nested:
        body["sampling_params"][field] = value
    else:
        body.pop("text", None) if field == "input_ids" else None
        body[field] = value
    content = dump(body)
    try:
        status, data, _ = send(http, path, content.encode())
    except httpx.TransportError as error:
        return f"{path} {content}: the connection failed: {error!r}"
    if status != 400:
        shown = f": {data[:140]!r}" if status >= 300 else " (accepted)"
        return f"{path} {field}={dump(value)}: HTTP {status}{shown}"
    problem = error_shape_problem(status, data)
    if problem:
        return f"{path} {field}={dump(value)}: {problem}"
    error = json.loads(data)["error"]
    param = error["param"] or ""
    accepted = {field, f"sampling_params.{field}"} | ({"prompt"} if field == "input_ids" else set())
    # As for messages.0.role, a nested field's param may be its top-level field if the message names it.
    nested_ok = nested and param == "sampling_params" and field in error["message"]
    if param not in accepted and not nested_ok:
        return f"{path} {field}={dump(value)}: the error names {param!r}: {error['message'][:120]}"
    return None


# ----- the issue's hostile requests next to a bystander stream ---------------------------------

ISSUE_CASES = [  # (path, body, whether it must be refused with 400)
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 4, "temperature": NaN}', True),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 4, "temperature": Infinity}', True),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 4, "temperature": 1e400}', True),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 4, "repetition_penalty": NaN}', True),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 4, "repetition_penalty": 1e-45}', False),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 4, "temperature": 1, "top_k": 9223372036854775808}', False),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 4, "temperature": 1, "top_k": 18446744073709551616}', False),
    ("/v1/completions", '{"prompt": [true, false], "max_tokens": 4}', True),
    ("/v1/completions", '{"prompt": [1.0, 2.0], "max_tokens": 4}', True),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": "4"}', True),
    ("/v1/chat/completions", ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, '
                              '"temperature": NaN, "stream": true}'), True),
    ("/v1/chat/completions", ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, '
                              '"repetition_penalty": 1e-45, "stream": true}'), False),
    ("/generate", '{"text": "hi", "sampling_params": {"max_new_tokens": 4, "temperature": NaN}}', True),
    ("/generate", '{"text": "hi", "sampling_params": {"max_new_tokens": 4, "top_k": 9223372036854775808}}', False),
]


def _case_id(path: str, content: str) -> str:
    """completions-temperature=1e400: the endpoint and the hostile fields as sent."""
    hostile = re.findall(r'"(temperature|repetition_penalty|top_k|max_tokens)": ([^,}]+)|"prompt": (\[[^]]*\])', content)
    shown = [f"{name}={value}" if name else f"prompt={prompt}" for name, value, prompt in hostile
             if not (name == "max_tokens" and value == "4") and not (name == "temperature" and value == "1")]
    name = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/generate": "generate"}[path]
    return f"{name}-{'-'.join(shown)}".replace(" ", "")


@pytest.mark.parametrize("path, content, must_refuse", ISSUE_CASES, ids=[_case_id(p, c) for p, c, _ in ISSUE_CASES])
def test_an_issue_case_does_not_hurt_a_bystander_stream(server, http, path, content, must_refuse):
    bystander: dict[str, Any] = {}
    first_event = threading.Event()

    def run_bystander() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True, "temperature": 0,
                "stream": True}
        with httpx.Client(base_url=server.base_url, headers=auth(), timeout=60) as client, \
                client.stream("POST", "/v1/completions", json=body) as response:
            bystander["status"] = response.status_code
            lines = []
            for line in response.iter_lines():
                lines.append(line)
                if line.startswith("data: "):
                    first_event.set()
            bystander["events"] = sse_events("\n".join(lines))
        first_event.set()

    thread = threading.Thread(target=run_bystander, daemon=True)
    thread.start()
    assert first_event.wait(30), "the bystander stream never started"
    status, data, streamed = send(http, path, content.encode())
    thread.join(60)
    assert not thread.is_alive(), "the bystander stream never ended"

    events = bystander["events"]
    errors = stream_error_events(events)
    finals = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1] if json.loads(e).get("choices")]
    assert bystander["status"] == 200 and not errors and events[-1] == "[DONE]", \
        f"the bystander was hurt by {content}: {errors or events[-3:]}"
    assert finals[-1] == "length" and len(finals) == 48, f"the bystander ended {finals[-1]!r} after {len(finals)}"
    check_response(path, content.encode(), status, data, streamed)
    if must_refuse:
        assert status == 400, f"{path} answered {status} to {content}: {data[:300]!r}"
    assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200

"""Structured outputs, measured through the server: the grammar mask's cost per step, compile time
per schema (cold and cached), and decode TBT at 8 streams with 0, 1 and 8 of them constrained,
against vLLM's CPU build doing the same.

Every request is a streamed chat completion (`/v1/chat/completions`, the default model's chat
template applied by the server), greedy (temperature 0), with a system message "You are a helpful
assistant. Session <tag>." whose tag is the run's (so no run reads another's prompt from a
prefix cache, while every run asks the same questions).

Compile, per schema (`COMPILE_CASES`: any JSON object, a fresh server's first grammar (a
chunkserve engine loads the vocabulary into the grammar library right after start, before
this request; vLLM when the first grammar arrives); the small,
nested (31 properties) and tool-call schemas and the email regex of benchmarks/engine/grammar_backends.py;
the person schema of the decode runs): on each fresh server, before anything else constrained,
each case's question is sent three times, one at a time, --compile-max-tokens (8) tokens each,
with three session tags (same length, so three prompts of the same size none of which hits the
prefix cache): unconstrained (the TTFT reference), constrained (cold: the first compile of the
grammar in this server) and constrained again (cached: the same grammar text, nothing to
compile). JSON schemas go as `response_format: {"type": "json_schema", "json_schema": {"name",
"schema", "strict": true}}` (every object of these schemas already says additionalProperties
false, so strict means the same on both systems), the regex as vLLM's
`structured_outputs: {"regex": ...}`, any JSON as `response_format: {"type": "json_object"}`.
chunkserve: compiles and compile seconds are the change of the
`chunkserve:structured_output_compile_seconds` histogram's count and sum across the request
(the compile thread's time, vocabulary load excluded), checked against the `grammar_compile_s`
of the step records in the request's window (`GET /debug/steps`, the admin key); for every
system the TTFT of the three requests (cold - unconstrained is what a request waits for its
grammar; vLLM exposes no compile metric, so for it TTFT is all there is).

Decode: --streams (8) streams, each sending --requests-per-stream (3) requests one after the
other, so exactly N streams are constrained at every moment of a run with N = 0, 1 and 8
(--constrained). Each request asks for a fictional person as JSON ("Describe a fictional
{occupation} from {city} as a JSON object with the fields name, age, email, city, occupation,
hobbies, married and bio.", occupations x cities in a --seed order, the same questions in
every run and for every system), at most --max-tokens (128) tokens: ignore_eos cannot be used
(a finished grammar allows only EOS), so requests end on EOS or at max_tokens and the tables give
the mean output tokens. Constrained streams add `response_format` json_schema with
`PERSON_SCHEMA` (8 properties, strict); the others ask the same questions without it. A warm-up
burst (8 requests, half constrained, 16 tokens, a session of its own) precedes the runs, so the
person schema is compiled and cached before them (a run compiling anything is reported).

Per run and class (constrained / unconstrained streams): TBT per request ((last token time -
first) / (tokens - 1), counting the stream events that carry a token: content or the finish
reason, so a request that ends on EOS counts the EOS step) p50/p99 over requests, and every gap
between consecutive token events of every request of the class, p50/p99; TTFT p50; mean output
tokens (usage); finish reasons; valid outputs (constrained: parses and validates against the
schema with jsonschema; unconstrained: parses as JSON at all). Per run: output tok/s (usage
completion tokens / the run's wall time). chunkserve only, from the step records of the run's
window: steps, steps whose `grammar_mask_s` is above 0, its p50/p99 over those (at 81784c1 every
step records a few µs, the timed loop over the step's rows, constrained or not), its share of their
step time (sum of mask seconds / sum of `duration_s`, which spans scheduling, the forward pass,
sampling and the output update), the step time p50, compiles during the run (expected 0), and the
`chunkserve:structured_output_mask_seconds` histogram's mean over the run as a cross-check.

Sampler (in this process, before any server): the step records time the scheduler filling the
bitmasks; applying them is the sampler's, inside the step. `sample_runs` on --streams greedy rows
of random logits over the default model's 49,152 tokens with 0, 1 and all rows masked (each mask
a random quarter of the vocabulary), the cases alternating call by call, --sampler-iterations
calls each: the median's growth over no mask is the apply cost per step.

Servers: chunkserve (`chunkserve serve --max-num-batched-tokens 512 --admin-api-key ...`,
OMP_NUM_THREADS unset, the default model); vLLM's CPU build through benchmarks/peers/start_vllm.sh
(same --max-num-batched-tokens; its structured-output backend `auto`: xgrammar, with
guidance for what xgrammar cannot express). One fresh server per system and round; rounds
alternate the order of the systems and of the N = 0/1/8 runs. If vLLM's constrained requests
fail, its constrained runs are skipped and the output says why.

    .venv/bin/python -m benchmarks.engine.structured_outputs --out structured_outputs.json     # ~20 min: 2 rounds
    .venv/bin/python -m benchmarks.engine.structured_outputs --rounds 3 --vllm-rounds 1 --out so.json
    .venv/bin/python -m benchmarks.engine.structured_outputs --rounds 1 --max-tokens 32 --requests-per-stream 1 \\
        --systems chunkserve --out /tmp/so_smoke.json                                # a short check
    .venv/bin/python -m benchmarks.engine.structured_outputs --dry-run --sampler-iterations 2   # the plan, no server
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import httpx
import numpy as np
from benchmarks.support import (  # benchmarks/support.py
    EMAIL_REGEX, NESTED_SCHEMA, SMALL_SCHEMA, TOOL_SCHEMA, VLLM_SCRIPT, peer_missing)

from chunkserve.bench.host import machine
from chunkserve.bench.service import STEPS_FETCHED, Service, stop_all

SYSTEMS = ("chunkserve", "vllm")
CHUNKSERVE_START_TIMEOUT_S = 300
VLLM_START_TIMEOUT_S = 900
REQUEST_TIMEOUT_S = 600
SMOLLM2_VOCAB = 49152  # the default model's vocabulary: the sampler measurement's row width

PERSON_SCHEMA = {  # the decode runs' schema: 8 properties, every one required, closed
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string"},
        "city": {"type": "string"},
        "occupation": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
        "married": {"type": "boolean"},
        "bio": {"type": "string"},
    },
    "required": ["name", "age", "email", "city", "occupation", "hobbies", "married", "bio"],
    "additionalProperties": False,
}
PERSON_QUESTION = ("Describe a fictional {} from {} as a JSON object with the fields name, age, email, city, "
                   "occupation, hobbies, married and bio.")
OCCUPATIONS = ("teacher", "baker", "pilot", "nurse", "carpenter", "chemist", "farmer", "librarian", "painter",
               "plumber", "journalist", "violinist")
CITIES = ("Lisbon", "Osaka", "Nairobi", "Toronto", "Lima", "Oslo", "Cairo", "Sydney", "Austin", "Prague")
SYSTEM_MESSAGE = "You are a helpful assistant. Session {}."  # the tag: the run's, always 3 characters


def json_schema_form(name: str, schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                                        "strict": True}}}


PERSON_FORM = json_schema_form("person", PERSON_SCHEMA)
# (name, the request fields that constrain it, the question): the first is a fresh server's first grammar
COMPILE_CASES = (
    ("any JSON object (first grammar)", {"response_format": {"type": "json_object"}},
     "Give an example of a JSON object describing a book."),
    ("small schema (2 properties)", json_schema_form("small", SMALL_SCHEMA),
     "Give the name and age of a fictional person as JSON."),
    ("nested schema (31 properties)", json_schema_form("order", NESTED_SCHEMA),
     "Write an example online shop order as JSON."),
    ("tool-call schema", json_schema_form("get_weather", TOOL_SCHEMA),
     "Give the arguments of a request for the weather forecast in Paris as JSON."),
    ("email regex", {"structured_outputs": {"regex": EMAIL_REGEX}}, "Write an example email address."),
    ("person schema (decode runs)", PERSON_FORM, PERSON_QUESTION.format("teacher", "Lisbon")),
)
COMPILE_TAGS = ("c{}u", "c{}a", "c{}b")  # unconstrained, cold, cached (3 characters for case indices < 10)
WARMUP_TAG = "wup"
WARMUP_MAX_TOKENS = 16


# ----- servers -------------------------------------------------------------------------------

class Server(Service):
    """A server of one system (the harness's Service, in its own process group: its engine
    processes go with it), with what the runs read from it."""

    def __init__(self, system: str, command: list[str], log_path: str, start_timeout_s: float,
                 admin_key: str | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        super().__init__(command, log_path, env=env, label=system, hide=[admin_key] if admin_key else [],
                         start_timeout_s=start_timeout_s)
        self.system, self.admin_key, self.model = system, admin_key, ""

    def wait_healthy(self) -> float:
        """Seconds to a healthy /health; then the served model's name is known."""
        seconds = super().wait_healthy()
        self.model = httpx.get(f"{self.url}/v1/models", timeout=30).json()["data"][0]["id"]
        return seconds

    def histograms(self) -> dict[str, float]:
        """chunkserve's structured-output histograms: compile and mask count and sum (zeros for vLLM)."""
        if self.system != "chunkserve":
            return {f"{kind}_{stat}": 0.0 for kind in ("compile", "mask") for stat in ("count", "sum")}
        metrics = self.metrics()
        return {f"{kind}_{stat}": metrics.get(f"chunkserve:structured_output_{kind}_seconds_{stat}", 0.0)
                for kind in ("compile", "mask") for stat in ("count", "sum")}

    def settled_histograms(self) -> dict[str, float]:
        """The histograms once two reads 0.3 s apart agree (a step's record may follow its last token)."""
        last = self.histograms()
        for _ in range(10):
            time.sleep(0.3)
            now = self.histograms()
            if now == last:
                break
            last = now
        return last

    def steps_between(self, since: float, until: float) -> list[dict]:
        """chunkserve's step records that started in [since, until] (wall clock); [] for vLLM."""
        if self.system != "chunkserve":
            return []
        records = self.steps(self.admin_key)
        if len(records) >= STEPS_FETCHED and records[0]["start_time"] > since:
            print(f"warning: {self.system}: /debug/steps did not reach back to the window's start", file=sys.stderr)
        return [r for r in records if since <= r["start_time"] <= until]


def server_command(system: str, args: argparse.Namespace, admin_key: str) -> list[str]:
    """The system's start command; the harness gives it its port (`--port`, or vLLM's `{port}`)."""
    budget = ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if system == "chunkserve":
        return [sys.executable, "-m", "chunkserve", "serve", "--host", "127.0.0.1", *budget,
                "--admin-api-key", admin_key, *args.server_arg]
    return ["bash", args.vllm_script, "{port}", *budget, *args.vllm_arg]


def start_system(system: str, args: argparse.Namespace, log_path: str) -> Server:
    if system == "chunkserve":
        key = secrets.token_hex(16)
        return Server(system, server_command(system, args, key), log_path, CHUNKSERVE_START_TIMEOUT_S, key)
    return Server(system, server_command(system, args, ""), log_path, VLLM_START_TIMEOUT_S)


# ----- requests ------------------------------------------------------------------------------

@dataclass
class ChatResult:
    """One streamed chat request as the client saw it."""

    tag: str
    question: str
    constrained: bool
    stream: int
    send_time: float
    token_times: list[float] = field(default_factory=list)  # events carrying a token (content or finish reason)
    end_time: float = 0.0
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    ok: bool = False
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.send_time if self.token_times else None

    @property
    def tbt(self) -> float | None:
        """Seconds per token after the first: (last - first) / (tokens - 1)."""
        tokens = max(self.completion_tokens, len(self.token_times))
        if len(self.token_times) < 2 or tokens < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (tokens - 1)

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class ChatSpec:
    tag: str
    question: str
    form: dict | None  # the fields that constrain it, or None
    max_tokens: int
    stream: int = 0


def chat_body(model: str, spec: ChatSpec) -> dict:
    body = {"model": model,
            "messages": [{"role": "system", "content": SYSTEM_MESSAGE.format(spec.tag)},
                         {"role": "user", "content": spec.question}],
            "max_tokens": spec.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if spec.form:
        body.update(spec.form)
    return body


async def send_chat(client: httpx.AsyncClient, server: Server, spec: ChatSpec) -> ChatResult:
    """Stream one chat completion and time its token events; failures are recorded, never raised."""
    result = ChatResult(spec.tag, spec.question, spec.form is not None, spec.stream, time.time())
    try:
        async with client.stream("POST", f"{server.url}/v1/chat/completions", json=chat_body(server.model, spec),
                                 timeout=REQUEST_TIMEOUT_S) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:500]}"
            else:
                await read_chat_events(response, result)
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        result.error = f"{type(error).__name__}: {error}"
    result.end_time = time.time()
    result.ok = result.error is None
    return result


async def read_chat_events(response: httpx.Response, result: ChatResult) -> None:
    """The SSE stream into `result`. A token event has content or a finish reason (a request that
    ends on EOS gets an event with empty content and finish_reason "stop" for its EOS step);
    the role-only first event and the usage event are not tokens."""
    async for line in response.aiter_lines():
        now = time.time()
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            return
        event = json.loads(payload)
        if event.get("error"):
            result.error = f"stream error: {json.dumps(event['error'])[:500]}"
            return
        for choice in event.get("choices") or []:
            content = (choice.get("delta") or {}).get("content") or ""
            if content or choice.get("finish_reason") is not None:
                result.token_times.append(now)
                result.text += content
            if choice.get("finish_reason") is not None:
                result.finish_reason = choice["finish_reason"]
        if event.get("usage"):
            result.completion_tokens = event["usage"].get("completion_tokens") or 0
            result.prompt_tokens = event["usage"].get("prompt_tokens") or 0
    result.error = "the stream ended without [DONE]"


async def run_streams(server: Server, streams: list[list[ChatSpec]]) -> list[ChatResult]:
    """Each stream sends its requests one after the other; the streams run at once."""
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=len(streams) + 2,
                                                                   max_keepalive_connections=len(streams) + 2)) as c:
        async def one(specs: list[ChatSpec]) -> list[ChatResult]:
            return [await send_chat(c, server, spec) for spec in specs]

        done = await asyncio.gather(*(one(specs) for specs in streams))
    return [r for results in done for r in results]


def one_request(server: Server, spec: ChatSpec) -> ChatResult:
    async def go() -> ChatResult:
        async with httpx.AsyncClient(timeout=None) as client:
            return await send_chat(client, server, spec)
    return asyncio.run(go())


# ----- compile -------------------------------------------------------------------------------

def measure_compiles(server: Server, args: argparse.Namespace) -> list[dict]:
    """Each case: unconstrained, cold, cached, one request at a time (see the docstring), after one
    unconstrained request (a fresh server's first request is slow), reported as the case "first request"."""
    first = one_request(server, ChatSpec("ini", COMPILE_CASES[0][2], None, args.compile_max_tokens))
    rows = [{"case": "first request", "phase": "unconstrained", "ok": first.ok, "error": first.error,
             "ttft_ms": 1000 * first.ttft if first.ttft is not None else None, "compiles": 0.0, "compile_ms": 0.0,
             "step_compile_ms": [], "prompt_tokens": first.prompt_tokens, "text": first.text}]
    for index, (name, form, question) in enumerate(COMPILE_CASES):
        for tag, constrained, phase in zip(COMPILE_TAGS, (False, True, True), ("unconstrained", "cold", "cached")):
            spec = ChatSpec(tag.format(index), question, form if constrained else None, args.compile_max_tokens)
            before = server.settled_histograms()
            start = time.time()
            result = one_request(server, spec)
            after = server.settled_histograms()
            steps = server.steps_between(start, time.time())
            rows.append({
                "case": name, "phase": phase, "ok": result.ok, "error": result.error,
                "ttft_ms": 1000 * result.ttft if result.ttft is not None else None,
                "compiles": after["compile_count"] - before["compile_count"],
                "compile_ms": 1000 * (after["compile_sum"] - before["compile_sum"]),
                "step_compile_ms": [1000 * s for r in steps for s in r.get("grammar_compile_s") or ()],
                "prompt_tokens": result.prompt_tokens, "text": result.text,
            })
            if not result.ok:
                print(f"warning: {server.system}: {name} ({phase}): {result.error}", file=sys.stderr)
    return rows


# ----- decode runs ---------------------------------------------------------------------------

def questions(args: argparse.Namespace) -> list[str]:
    pool = [PERSON_QUESTION.format(o, c) for c in CITIES for o in OCCUPATIONS]
    order = np.random.default_rng(args.seed).permutation(len(pool))
    need = args.streams * args.requests_per_stream
    return [pool[int(order[i % len(pool)])] for i in range(need)]


def run_specs(args: argparse.Namespace, constrained: int, qs: list[str]) -> list[list[ChatSpec]]:
    """Stream s asks questions s * R .. s * R + R - 1; streams 0 .. constrained - 1 are constrained."""
    tag = f"r{constrained:02d}"
    r = args.requests_per_stream
    return [[ChatSpec(tag, qs[s * r + j], PERSON_FORM if s < constrained else None, args.max_tokens, s)
             for j in range(r)] for s in range(args.streams)]


def warm_up(server: Server, args: argparse.Namespace, qs: list[str]) -> list[ChatResult]:
    streams = [[ChatSpec(WARMUP_TAG, qs[s % len(qs)], PERSON_FORM if s % 2 == 0 else None, WARMUP_MAX_TOKENS, s)]
               for s in range(args.streams)]
    return asyncio.run(run_streams(server, streams))


def valid(result: ChatResult) -> bool:
    """Constrained: parses and validates against the person schema; unconstrained: parses as JSON."""
    try:
        value = json.loads(result.text)
    except ValueError:
        return False
    if not result.constrained:
        return True
    try:
        import jsonschema
    except ImportError:
        return isinstance(value, dict) and set(value) == set(PERSON_SCHEMA["properties"])
    try:
        jsonschema.validate(value, PERSON_SCHEMA)
        return True
    except jsonschema.ValidationError:
        return False


def ms_stats(values) -> dict:
    array = np.asarray([1000.0 * v for v in values if v is not None], dtype=float)
    if array.size == 0:
        return {"p50": None, "p99": None, "max": None, "mean": None, "count": 0}
    return {"p50": float(np.percentile(array, 50)), "p99": float(np.percentile(array, 99)),
            "max": float(array.max()), "mean": float(array.mean()), "count": int(array.size)}


def class_summary(results: list[ChatResult]) -> dict:
    done = [r for r in results if r.ok]
    finish: dict[str, int] = {}
    for r in done:
        finish[str(r.finish_reason)] = finish.get(str(r.finish_reason), 0) + 1
    events = sum(len(r.token_times) for r in done)
    tokens = sum(r.completion_tokens for r in done)
    return {
        "requests": len(results), "failed": len(results) - len(done),
        "mean_output_tokens": statistics.mean(r.completion_tokens for r in done) if done else None,
        "tbt_ms": ms_stats(r.tbt for r in done), "gap_ms": ms_stats(g for r in done for g in r.gaps),
        "ttft_ms": ms_stats(r.ttft for r in done), "finish_reasons": finish,
        "valid": sum(valid(r) for r in done), "tokens_per_event": tokens / events if events else None,
        "mean_prompt_tokens": statistics.mean(r.prompt_tokens for r in done) if done else None,
        "errors": sorted({r.error for r in results if r.error})[:3],
    }


def step_summary(steps: list[dict], before: dict, after: dict) -> dict:
    masked = [s for s in steps if s.get("grammar_mask_s")]
    mask_count = after["mask_count"] - before["mask_count"]
    return {
        "steps": len(steps), "steps_with_mask": len(masked),
        "mask_us": {k: (None if v is None else 1000 * v) for k, v in
                    ms_stats(s["grammar_mask_s"] for s in masked).items() if k != "count"},
        "mask_share": (sum(s["grammar_mask_s"] for s in masked) / sum(s["duration_s"] for s in masked)
                       if masked else None),
        "step_ms": ms_stats(s["duration_s"] for s in steps),
        "masked_step_ms": ms_stats(s["duration_s"] for s in masked),
        "compiles": sum(len(s.get("grammar_compile_s") or ()) for s in steps),
        "metrics_mask_steps": mask_count,
        "metrics_mask_mean_us": 1e6 * (after["mask_sum"] - before["mask_sum"]) / mask_count if mask_count else None,
        "metrics_compiles": after["compile_count"] - before["compile_count"],
    }


def measure_run(server: Server, args: argparse.Namespace, constrained: int, qs: list[str]) -> tuple[dict, list]:
    before = server.settled_histograms()
    start = time.time()
    results = asyncio.run(run_streams(server, run_specs(args, constrained, qs)))
    end = time.time()
    after = server.settled_histograms()
    done = [r for r in results if r.ok]
    duration = max(r.end_time for r in results) - min(r.send_time for r in results)
    row = {
        "constrained_streams": constrained, "duration_s": duration,
        "completion_tokens": sum(r.completion_tokens for r in done),
        "output_tok_s": sum(r.completion_tokens for r in done) / duration if duration > 0 else 0.0,
        "all": class_summary(results),
        "constrained": class_summary([r for r in results if r.constrained]) if constrained else None,
        "unconstrained": (class_summary([r for r in results if not r.constrained])
                          if constrained < args.streams else None),
        "steps": step_summary(server.steps_between(start, end), before, after) if server.system == "chunkserve"
        else None,
    }
    return row, results


def sanity(row: dict, system: str) -> list[str]:
    """What in a run's numbers makes no sense (reported, never fatal)."""
    problems = []
    for cls in ("constrained", "unconstrained"):
        summary = row[cls]
        if not summary:
            continue
        if summary["failed"]:
            problems.append(f"{summary['failed']} {cls} request(s) failed: {summary['errors']}")
        tpe = summary["tokens_per_event"]
        if tpe is not None and abs(tpe - 1) > 0.02:
            problems.append(f"{cls}: {tpe:.3f} tokens per stream event (TBT gaps then span several tokens)")
    c = row["constrained"]
    if c and c["finish_reasons"].get("stop", 0) > c["valid"]:
        problems.append(f"constrained: {c['finish_reasons'].get('stop', 0)} finished on EOS but only "
                        f"{c['valid']} validate against the schema")
    steps = row["steps"]
    if system == "chunkserve" and steps:
        if row["constrained_streams"] == 0 and steps["steps_with_mask"] and (steps["mask_us"]["p50"] or 0) > 20:
            problems.append(f"no constrained request, yet {steps['steps_with_mask']} steps spent "
                            f"{steps['mask_us']['p50']:.0f} µs (p50) filling masks")
        if row["constrained_streams"] and not steps["steps_with_mask"]:
            problems.append("constrained requests, yet no step filled a mask")
        if steps["compiles"] or steps["metrics_compiles"]:
            problems.append(f"{steps['compiles']} grammar(s) compiled during the run (the warm-up should have "
                            "cached the schema)")
    return problems


# ----- tables --------------------------------------------------------------------------------

def med(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def print_compile_table(compiles: list[dict], systems: list[str]) -> None:
    print("\n**Compile per schema** (each fresh server, one request at a time; medians over rounds; "
          "TTFT in ms, compile in ms)\n")
    header = ["schema"]
    if "chunkserve" in systems:
        header += ["chunkserve compile, cold", "compiles when cached", "TTFT unconstr. / cold / cached"]
    if "vllm" in systems:
        header += ["vLLM TTFT unconstr. / cold / cached"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, _, _ in COMPILE_CASES:
        cells = [name]
        for system in systems:
            rows = [r for r in compiles if r["system"] == system and r["case"] == name]
            ttft = {phase: med(r["ttft_ms"] for r in rows if r["phase"] == phase and r["ok"])
                    for phase in ("unconstrained", "cold", "cached")}
            ttft_cell = " / ".join(fmt(ttft[p], 0) for p in ("unconstrained", "cold", "cached"))
            if system == "chunkserve":
                cold = [r for r in rows if r["phase"] == "cold" and r["ok"]]
                cached = [r for r in rows if r["phase"] == "cached" and r["ok"]]
                cold_cell = fmt(med(r["compile_ms"] for r in cold), 2)
                if cold:
                    counts = sorted({int(r["compiles"]) for r in cold})
                    if counts != [1]:
                        cold_cell += f" ({'/'.join(map(str, counts))} compiles)"
                cached_cell = "/".join(str(int(r["compiles"])) for r in cached) or "-"
                cells += [cold_cell, cached_cell, ttft_cell]
            else:
                failed = [r for r in rows if r["phase"] != "unconstrained" and not r["ok"]]
                cells.append(ttft_cell + (f" ({len(failed)} failed)" if failed else ""))
        print("| " + " | ".join(cells) + " |")


def print_decode_tables(results: list[dict], systems: list[str], args: argparse.Namespace) -> None:
    print(f"\n**Decode at {args.streams} streams** (medians over rounds; TBT per request = (last - first token) / "
          f"(tokens - 1); gap = every inter-token gap of every request of the class; max_tokens {args.max_tokens})\n")
    header = ("system", "constrained streams", "class", "requests", "mean out tokens", "TBT p50 ms", "TBT p99 ms",
              "gap p50 ms", "gap p99 ms", "TTFT p50 ms", "out tok/s (run)", "valid / EOS-finished", "failed")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for system in systems:
        for k in args.constrained:
            rows = [r for r in results if r["system"] == system and r["constrained_streams"] == k]
            if not rows:
                continue
            for cls in ("constrained", "unconstrained"):
                summaries = [r[cls] for r in rows if r[cls]]
                if not summaries:
                    continue
                valid_cell = (f"{sum(s['valid'] for s in summaries)} / "
                              f"{sum(s['finish_reasons'].get('stop', 0) for s in summaries)}")
                print(f"| {system} | {k} | {cls} | {sum(s['requests'] for s in summaries)} | "
                      f"{fmt(med(s['mean_output_tokens'] for s in summaries))} | "
                      f"{fmt(med(s['tbt_ms']['p50'] for s in summaries))} | "
                      f"{fmt(med(s['tbt_ms']['p99'] for s in summaries))} | "
                      f"{fmt(med(s['gap_ms']['p50'] for s in summaries))} | "
                      f"{fmt(med(s['gap_ms']['p99'] for s in summaries))} | "
                      f"{fmt(med(s['ttft_ms']['p50'] for s in summaries), 0)} | "
                      f"{fmt(med(r['output_tok_s'] for r in rows))} | {valid_cell} | "
                      f"{sum(s['failed'] for s in summaries)} |")
    if "chunkserve" in systems:
        print("\n**chunkserve's grammar mask per step** (step records of each run's window; medians over rounds)\n")
        header = ("constrained streams", "steps", "steps with mask time > 0", "mask p50 µs", "mask p99 µs",
                  "mask max µs",
                  "share of masked steps' time", "masked step p50 ms", "step p50 ms (all)", "compiles in run",
                  "mask mean µs (/metrics)")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for k in args.constrained:
            steps = [r["steps"] for r in results if r["system"] == "chunkserve" and r["constrained_streams"] == k
                     and r["steps"]]
            if not steps:
                continue
            share = med(s["mask_share"] for s in steps)
            largest = max((s["mask_us"]["max"] for s in steps if s["mask_us"]["max"] is not None), default=None)
            cells = [str(k), fmt(med(s["steps"] for s in steps), 0), fmt(med(s["steps_with_mask"] for s in steps), 0),
                     fmt(med(s["mask_us"]["p50"] for s in steps), 0), fmt(med(s["mask_us"]["p99"] for s in steps), 0),
                     fmt(largest, 0), "-" if share is None else f"{100 * share:.2f}%",
                     fmt(med(s["masked_step_ms"]["p50"] for s in steps)), fmt(med(s["step_ms"]["p50"] for s in steps)),
                     str(sum(s["compiles"] for s in steps)), fmt(med(s["metrics_mask_mean_us"] for s in steps), 0)]
            print("| " + " | ".join(cells) + " |")


def print_rounds(results: list[dict]) -> None:
    print("\nper round (TBT p50 / gap p99 ms, constrained | unconstrained; out tok/s):")
    for r in results:
        def cell(s):
            return "-" if not s else f"{fmt(s['tbt_ms']['p50'])} / {fmt(s['gap_ms']['p99'])}"
        print(f"- {r['system']} round {r['round'] + 1} ({r['order_in_round']} in its round), "
              f"{r['constrained_streams']} constrained: {cell(r['constrained'])} | {cell(r['unconstrained'])}; "
              f"{fmt(r['output_tok_s'])} tok/s")


# ----- main ----------------------------------------------------------------------------------

def csv_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def dry_run(args: argparse.Namespace, notes: list[str], sampler_rows: list[dict]) -> None:
    """What a run would do: its plan and each system's server command (the harness adds the port)."""
    for note in notes:
        print(f"note: {note}")
    if sampler_rows:
        print_sampler_table(sampler_rows)
    print(f"\n{len(questions(args))} questions; compile cases: {', '.join(name for name, _, _ in COMPILE_CASES)}")
    for round_index, system, order in plan(args):
        print(f"round {round_index + 1}: {system}, constrained streams {order}")
    for system in args.systems:
        print(f"{system}: {' '.join(server_command(system, args, 'ADMIN_KEY'))}")


def plan(args: argparse.Namespace) -> list[tuple[int, str, list[int]]]:
    """(round, system, the order of its runs): systems in turn, their order and the runs' order
    reversed every other round; vLLM only in its first --vllm-rounds rounds."""
    out = []
    for r in range(max(args.rounds, args.vllm_rounds)):
        systems = [s for s in args.systems if r < (args.rounds if s == "chunkserve" else args.vllm_rounds)]
        order = args.constrained if r % 2 == 0 else args.constrained[::-1]
        for system in (systems if r % 2 == 0 else systems[::-1]):
            out.append((r, system, list(order)))
    return out


def sampler_mask_cost(rows: int, vocab: int, iterations: int, seed: int) -> list[dict]:
    """The other half of the mask's cost, in this process: the sampler applying the bitmasks
    (`sample_runs` with `bitmasks`, greedy, `rows` rows of random float32 logits over `vocab`
    tokens) with 0, 1 and `rows` rows masked, each mask allowing a random quarter of the
    vocabulary. The three cases alternate call by call; medians per case."""
    import torch

    from chunkserve.sampling_params import SamplingParams
    from chunkserve.worker.sampler import SamplingState, sample_runs

    generator = np.random.default_rng(seed)
    words = -(-vocab // 32)

    def bitmask() -> np.ndarray:
        allowed = generator.random(words * 32) < 0.25
        allowed[vocab:] = False
        return np.packbits(allowed, bitorder="little").view("<i4").reshape(1, words).copy()

    logits = torch.from_numpy(generator.standard_normal((rows, vocab), dtype=np.float32))
    states = [SamplingState(SamplingParams(temperature=0.0), [1], 1, None, None) for _ in range(rows)]
    drafts = [[] for _ in range(rows)]
    masks = [bitmask() for _ in range(rows)]
    default = torch.Generator().manual_seed(seed)
    cases = sorted({0, 1, rows})
    times: dict[int, list[float]] = {k: [] for k in cases}
    for _ in range(iterations):
        for k in cases:
            bitmasks = [masks[i] if i < k else None for i in range(rows)] if k else None
            batch = logits.clone()
            start = time.perf_counter()
            sample_runs(batch, states, drafts, default, bitmasks)
            times[k].append(time.perf_counter() - start)
    base = statistics.median(times[0])
    return [{"masked_rows": k, "rows": rows, "vocab": vocab, "median_ms": statistics.median(times[k]) * 1e3,
             "p99_ms": float(np.percentile(times[k], 99)) * 1e3,
             "over_unmasked_ms": (statistics.median(times[k]) - base) * 1e3} for k in cases]


def print_sampler_table(rows: list[dict]) -> None:
    print(f"\nsampler, bitmasks applied (in process; {rows[0]['rows']} greedy rows over {rows[0]['vocab']} tokens, "
          "medians of alternating calls)\n")
    print("| masked rows | sample_runs ms p50 | p99 | over no mask, ms |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['masked_rows']} | {row['median_ms']:.3f} | {row['p99_ms']:.3f} | {row['over_unmasked_ms']:.3f} |")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--constrained", default="0,1,8", help="constrained streams per run, comma-separated")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--requests-per-stream", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--compile-max-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--vllm-rounds", type=int, default=None, help="rounds of vLLM (default --rounds)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="every server's token budget")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="an extra flag for every chunkserve server (repeat it; use --server-arg=--flag)")
    parser.add_argument("--vllm-arg", action="append", default=[], help="an extra flag for every vLLM server")
    parser.add_argument("--vllm-script", default=VLLM_SCRIPT, help="starts vLLM: PORT [vLLM flags...]")
    parser.add_argument("--workdir", default=None, help="the servers' log (default: a temp dir)")
    parser.add_argument("--save-requests", action="store_true", help="keep every request (times, text) in --out")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--sampler-iterations", type=int, default=400,
                        help="calls per case of the in-process sampler measurement (0 skips it)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the plan and the servers' commands and measure the sampler; start no server")
    args = parser.parse_args()
    args.systems = csv_list(args.systems)
    args.constrained = [int(k) for k in csv_list(args.constrained)]
    if [s for s in args.systems if s not in SYSTEMS]:
        parser.error(f"unknown system(s): {[s for s in args.systems if s not in SYSTEMS]}")
    if any(k < 0 or k > args.streams for k in args.constrained):
        parser.error(f"--constrained must be within 0..{args.streams}")
    if args.vllm_rounds is None:
        args.vllm_rounds = args.rounds
    return args


@dataclass
class Collected:
    """Everything a run gathers, kept when it is interrupted so the report covers what finished."""

    notes: list[str]
    compiles: list[dict] = field(default_factory=list)
    results: list[dict] = field(default_factory=list)
    requests: list[dict] = field(default_factory=list)
    servers: list[dict] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    vllm_unconstrained_only: bool = False
    interrupted: bool = False


def run_schedule(args: argparse.Namespace, log_path: str, qs: list[str], out: Collected) -> None:
    """Every round of the plan, one server at a time; Ctrl-C ends it early (out.interrupted)."""
    try:
        for round_index, system, order in plan(args):
            print(f"[{time.strftime('%H:%M:%S')}] round {round_index + 1}: starting {system}", file=sys.stderr)
            server = start_system(system, args, log_path)
            try:
                measure_server(server, system, round_index, order, args, qs, out)
            finally:
                server.stop(wait_port=True)
    except KeyboardInterrupt:
        out.interrupted = True
    finally:
        stop_all()


def measure_server(server: Server, system: str, round_index: int, order: list[int], args: argparse.Namespace,
                   qs: list[str], out: Collected) -> None:
    """One started server's round: its compile requests, a warm-up, then a run per constrained count."""
    start_s = server.wait_healthy()
    t0 = time.monotonic()
    rows = measure_compiles(server, args)
    out.compiles += [{"system": system, "round": round_index, **r} for r in rows]
    compile_s = time.monotonic() - t0
    if system == "vllm" and all(not r["ok"] for r in rows if r["phase"] != "unconstrained"):
        errors = sorted({r["error"] for r in rows if r["error"]})
        note = f"vLLM's CPU build refused every constrained request: {errors[:2]}"
        if note not in out.notes:
            out.notes.append(note)
        out.vllm_unconstrained_only = True
    t0 = time.monotonic()
    warm = warm_up(server, args, qs)
    if any(not r.ok for r in warm):
        out.problems.append(f"{system} round {round_index + 1}: warm-up failures: "
                            f"{sorted({r.error for r in warm if r.error})[:2]}")
    out.servers.append({"system": system, "round": round_index, "start_s": start_s,
                        "compile_phase_s": compile_s, "warmup_s": time.monotonic() - t0, "model": server.model})
    for k in order:
        if system == "vllm" and out.vllm_unconstrained_only and k:
            continue
        print(f"[{time.strftime('%H:%M:%S')}] round {round_index + 1}: {system}, {k} constrained", file=sys.stderr)
        row, done = measure_run(server, args, k, qs)
        row.update({"system": system, "round": round_index, "order_in_round": order.index(k) + 1})
        for problem in sanity(row, system):
            message = f"{system} {k} constrained, round {round_index + 1}: {problem}"
            out.problems.append(message)
            print("warning: " + message, file=sys.stderr)
        out.results.append(row)
        out.requests += kept_requests(done, system, round_index, k, args.save_requests)


def kept_requests(done: list[ChatResult], system: str, round_index: int, k: int, save_all: bool) -> list[dict]:
    """With --save-requests every request; otherwise the outputs' text only (what the constraint
    did), one per class per run."""
    run = {"system": system, "round": round_index, "constrained_streams": k}
    if save_all:
        return [{**run, **{key: v for key, v in asdict(r).items()}} for r in done]
    kept = []
    for cls in (True, False):
        sample = next((r for r in done if r.constrained == cls and r.ok), None)
        if sample:
            kept.append({**run, "constrained": cls, "question": sample.question,
                         "text": sample.text, "finish_reason": sample.finish_reason})
    return kept


def print_report(args: argparse.Namespace, host: dict, out: Collected, sampler_rows: list[dict]) -> None:
    compiles, results = out.compiles, out.results
    systems = [s for s in args.systems if any(r["system"] == s for r in compiles)]
    print(f"\n{host['cpu']}, {host['cpus']} cores, AVX-512: {host['avx512_flags'] or 'none'}, commit {host['commit']}")
    print(f"rounds: chunkserve {args.rounds}, vLLM {args.vllm_rounds}; {args.streams} streams x "
          f"{args.requests_per_stream} requests each, at most {args.max_tokens} tokens, greedy; "
          f"--max-num-batched-tokens {args.max_num_batched_tokens}")
    for note in out.notes:
        print(f"note: {note}")
    if sampler_rows:
        print_sampler_table(sampler_rows)
    print_compile_table(compiles, systems)
    print_compile_notes(compiles, systems)
    print_decode_tables(results, systems, args)
    print_rounds(results)
    for system in systems:
        prompt = [r["all"]["mean_prompt_tokens"] for r in results if r["system"] == system]
        if prompt:
            print(f"{system}: mean prompt tokens of the decode requests {med(prompt):.1f}")
    if out.problems:
        print("\nnumbers that make no sense:\n" + "\n".join(f"- {p}" for p in out.problems))


def print_compile_notes(compiles: list[dict], systems: list[str]) -> None:
    """What frames the compile table: first-request TTFTs, prompt sizes, and chunkserve's two
    sources of its compile times side by side."""
    firsts = {system: med(r["ttft_ms"] for r in compiles if r["system"] == system and r["case"] == "first request")
              for system in systems}
    print("\nfirst request after start-up (unconstrained), TTFT ms: "
          + "; ".join(f"{system} {fmt(ttft, 0)}" for system, ttft in firsts.items()))
    for system in systems:
        rows = [r for r in compiles if r["system"] == system and r["case"] == COMPILE_CASES[-1][0]]
        if rows:
            print(f"\n{system}: prompt tokens of the compile requests {rows[0]['prompt_tokens']} (person question)")
    if "chunkserve" in systems:
        steps_vs_metrics = [(r["case"], r["compile_ms"], r["step_compile_ms"]) for r in compiles
                            if r["system"] == "chunkserve" and r["phase"] == "cold"]
        print("chunkserve cold compiles, /metrics against the step records (ms): "
              + "; ".join(f"{c}: {m:.2f} vs {'+'.join(f'{s:.2f}' for s in st) or 'none'}"
                          for c, m, st in steps_vs_metrics))


def write_results(path: str, args: argparse.Namespace, host: dict, out: Collected, sampler_rows: list[dict]) -> None:
    config = dict(vars(args))
    config["person_schema"] = PERSON_SCHEMA
    config["compile_cases"] = [{"name": n, "form": f, "question": q} for n, f, q in COMPILE_CASES]
    with open(path, "w") as f:
        json.dump({"machine": host, "config": config, "notes": out.notes, "sampler": sampler_rows,
                   "compiles": out.compiles, "results": out.results,
                   "servers": out.servers, "requests": out.requests, "problems": out.problems,
                   "interrupted": out.interrupted},
                  f, indent=1)
    print(f"\nwrote {path}", file=sys.stderr)


def main() -> None:
    args = parse_args()
    notes: list[str] = []
    if "vllm" in args.systems and (missing := peer_missing(args.vllm_script)):
        notes.append(f"vLLM not measured: {missing}")
        args.systems.remove("vllm")
    if "vllm" not in args.systems:
        args.vllm_rounds = 0
    workdir = args.workdir or ("(none: --dry-run)" if args.dry_run
                               else tempfile.mkdtemp(prefix="structured-outputs-bench-"))
    if not args.dry_run:
        os.makedirs(workdir, exist_ok=True)
    log_path = os.path.join(workdir, "servers.log")
    host = machine()
    print(f"{host['cpu']}, {host['cpus']} cores, AVX-512: {host['avx512_flags'] or 'none'}, commit {host['commit']}; "
          f"server logs in {log_path}", file=sys.stderr)

    sampler_rows = sampler_mask_cost(args.streams, SMOLLM2_VOCAB, args.sampler_iterations, args.seed) \
        if args.sampler_iterations else []
    if args.dry_run:
        dry_run(args, notes, sampler_rows)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs run_schedule's finally (and the harness's atexit)
    out = Collected(notes)
    run_schedule(args, log_path, questions(args), out)
    if out.interrupted:
        print(f"\ninterrupted: {len(out.results)} runs finished; reporting those", file=sys.stderr)
    print_report(args, host, out, sampler_rows)
    if args.out:
        write_results(args.out, args, host, out, sampler_rows)
    if out.interrupted:
        sys.exit(130)


if __name__ == "__main__":
    main()

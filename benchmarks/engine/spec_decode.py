"""Speculative decoding (n-gram prompt lookup): what it buys where the answer repeats the prompt,
what it costs where it does not, against vLLM's CPU build doing the same.

Two workloads, as token ids, the same requests for every system (--seed):

  high-overlap:  chat prompts (the default model's chat template, generation prompt added) whose
                 answer repeats or edits a passage of the prompt, in turn: "Rewrite this function
                 with type hints, changing nothing else:" + a function's source, "Repeat the
                 following passage exactly:" + a docstring, "Summarize, quoting its key sentences
                 verbatim:" + a docstring. Passages come from this Python's standard library
                 (inspect.getsource of the functions of STDLIB_MODULES, their functions', classes'
                 and the modules' own docstrings, a long module docstring cut at paragraphs),
                 120-400 tokens each; output length = the passage's tokens, clipped to [64, 384].
  chat:          open questions in the chat template ("Explain {} to a ten-year-old.", ... over 20
                 subjects), 128 output tokens: natural text that quotes nothing, the low-overlap case
                 in words (sharegpt-like's random-token prompts send SmolLM2 into loops, which n-gram
                 drafts predict well: it is not low-overlap for this model).
  sharegpt-like: `chunkserve bench serve`'s generator: random token ids, lognormal lengths, input
                 median 256, output median 128. Not a no-overlap control: on random ids, greedy and
                 past EOS, SmolLM2-135M soon loops ("SpecterSpecter..."), and n-gram drafts of a loop
                 are accepted (in the smoke run, 43 of 43 draft tokens).

Every request asks for exactly its output length (ignore_eos, min_tokens), greedy, streamed: the
same work for every system. For each --streams N, N * --requests-per-stream requests (at least
--min-requests) are queued at once with at most N in flight; every (workload, N) has its own
prompts, so no run reads another's prompt from a prefix cache.

Modes: chunkserve (`chunkserve serve --max-num-batched-tokens 512`, OMP_NUM_THREADS unset,
the default model) with speculation `off`, `always` and `auto` ({"method": "ngram",
"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5, "policy": ...}; auto
drafts only while the step-time model says drafts pay); vLLM's CPU build via
benchmarks/peers/start_vllm.sh (`vllm-off`, `vllm-ngram`: `--speculative-config` with method ngram
and the same k and lookup bounds; the same --max-num-batched-tokens). One fresh server per mode
and round runs every workload x streams after a warm-up; chunkserve's modes alternate their order
round by round, then vLLM's run (--vllm-rounds, default --rounds: each start takes ~4 minutes here).

Per (mode, workload, streams): output tok/s (completion tokens / the run's wall time), TPOT p50/p99
over requests ((last token time - first) / (completion tokens - 1): with drafts one stream event
can carry several tokens), TTFT p50, and from /metrics (`<prefix>:spec_decode_num_drafts_total`,
`..._num_draft_tokens_total`, `..._num_accepted_tokens_total`, before and after the run) the draft
runs, draft tokens, accepted tokens and the mean acceptance length 1 + accepted / drafts. Tables
give medians over rounds and out tok/s against `off` of the same system at the same streams (and
against chunkserve `off`). After the warm-up, --check-outputs high-overlap prompts are answered
once (48 tokens, greedy): each mode's answers are compared with its system's `off` answers.

    .venv/bin/python -m benchmarks.engine.spec_decode --out spec_decode.json          # ~1 h: all five modes
    .venv/bin/python -m benchmarks.engine.spec_decode --rounds 3 --vllm-rounds 1 --out spec_decode.json
    .venv/bin/python -m benchmarks.engine.spec_decode --modes off,always,auto --streams 1,2 \\
        --requests-per-stream 1 --max-output-len 16 --out /tmp/spec_smoke.json     # a short check
    .venv/bin/python -m benchmarks.engine.spec_decode --dry-run     # the workloads and the plan, no server
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import math
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
from benchmarks.support import VLLM_SCRIPT, peer_missing  # benchmarks/support.py
from tqdm import tqdm

from chunkserve.bench.client import RequestResult, run_requests
from chunkserve.bench.host import machine
from chunkserve.bench.metrics import ms_distribution, summarize
from chunkserve.bench.service import Service, stop_all
from chunkserve.bench.workloads import RequestSpec, build_workload, sharegpt_like_params

CHUNKSERVE_MODES = ("off", "always", "auto")
VLLM_MODES = {"vllm-off": "off", "vllm-ngram": "ngram"}
ALL_MODES = (*CHUNKSERVE_MODES, *VLLM_MODES)
WORKLOADS = ("high-overlap", "sharegpt-like", "chat")
CHUNKSERVE_START_TIMEOUT_S = 300
VLLM_START_TIMEOUT_S = 900

# high-overlap: passages of PASSAGE_TOKENS, answers of OUTPUT_CLIP tokens
STDLIB_MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "colorsys", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "difflib", "email.utils", "enum", "fnmatch", "fractions", "functools", "gettext", "glob",
    "heapq", "html", "inspect", "ipaddress", "json.decoder", "json.encoder", "locale", "logging", "operator",
    "os", "posixpath", "pprint", "queue", "random", "re", "sched", "shlex", "shutil", "statistics", "string",
    "subprocess", "tarfile", "tempfile", "textwrap", "tokenize", "typing", "urllib.parse", "uuid", "zipfile",
)
PASSAGE_TOKENS = (120, 400)
OUTPUT_CLIP = (64, 384)
TASKS = (  # (name, passage kind, the user message)
    ("edit", "code", "Rewrite this function with type hints, changing nothing else:\n\n```python\n{}\n```"),
    ("repeat", "doc", "Repeat the following passage exactly:\n\n{}"),
    ("quote", "doc", "Summarize, quoting its key sentences verbatim:\n\n{}"),
)
# chat: open questions whose answers quote nothing (low overlap in natural text)
CHAT_TEMPLATES = ("Explain {} to a ten-year-old.", "Write a short story about {}.", "What are the pros and cons of {}?",
                  "Give me three tips about {}.", "Describe the history of {} in a paragraph.")
CHAT_SUBJECTS = ("gardening", "the moon", "bicycles", "volcanoes", "coffee", "chess", "the ocean", "trains",
                 "photosynthesis", "music", "bees", "winter", "friendship", "robots", "bread", "rivers",
                 "the internet", "dinosaurs", "rain", "libraries")
CHAT_OUTPUT_LEN = 128
SHAREGPT_INPUT_MEDIAN = 256
SHAREGPT_OUTPUT_MEDIAN = 128
WARMUP_OUTPUT_LEN = 16
CHECK_OUTPUT_LEN = 48


# ----- workloads -----------------------------------------------------------------------------

def stdlib_passages(tokenizer) -> dict[str, list[tuple[str, str]]]:
    """{"code": [(name, source)], "doc": [(name, docstring)]}, every passage PASSAGE_TOKENS long
    (bare, without the prompt around it), in a fixed order."""
    low, high = PASSAGE_TOKENS

    def fits(text: str) -> bool:
        return low <= len(tokenizer.encode(text, add_special_tokens=False)) <= high

    code: list[tuple[str, str]] = []
    docs: list[tuple[str, str]] = []
    for module_name in STDLIB_MODULES:
        module = importlib.import_module(module_name)
        for name, member in inspect.getmembers(module):
            if not (inspect.isfunction(member) or inspect.isclass(member)) or member.__module__ != module.__name__:
                continue
            if inspect.isfunction(member):
                try:
                    source = inspect.getsource(member)
                except (OSError, TypeError):
                    source = ""
                if source and fits(source):
                    code.append((f"{module_name}.{name}", source))
            doc = inspect.getdoc(member)
            if doc and fits(doc):
                docs.append((f"{module_name}.{name}.__doc__", doc))
        for index, chunk in enumerate(paragraph_chunks(inspect.getdoc(module) or "", tokenizer, high)):
            if fits(chunk):
                docs.append((f"{module_name}.__doc__[{index}]", chunk))
    return {"code": code, "doc": docs}


def paragraph_chunks(text: str, tokenizer, max_tokens: int) -> list[str]:
    """Consecutive paragraphs joined while they stay within max_tokens."""
    chunks: list[str] = []
    current: list[str] = []
    for paragraph in (p for p in text.split("\n\n") if p.strip()):
        candidate = "\n\n".join([*current, paragraph])
        if current and len(tokenizer.encode(candidate, add_special_tokens=False)) > max_tokens:
            chunks.append("\n\n".join(current))
            current = [paragraph]
        else:
            current.append(paragraph)
    if current:
        chunks.append("\n\n".join(current))
    return chunks


def chat_prompt(tokenizer, message: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                        tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def high_overlap_pool(tokenizer, passages: dict[str, list[tuple[str, str]]], rng: np.random.Generator,
                      n: int) -> tuple[list[RequestSpec], list[dict]]:
    """n requests, the tasks in turn, each task's passages in its own seeded order (one passage
    again only once every passage of its kind was used); returns the specs and what each one is."""
    orders = {task: [int(i) for i in rng.permutation(len(passages[kind]))] for task, kind, _ in TASKS}
    used = {task: 0 for task, _, _ in TASKS}
    specs, about = [], []
    for i in range(n):
        task, kind, template = TASKS[i % len(TASKS)]
        order = orders[task]
        name, passage = passages[kind][order[used[task] % len(order)]]
        used[task] += 1
        passage_tokens = len(tokenizer.encode(passage, add_special_tokens=False))
        output_len = int(np.clip(passage_tokens, *OUTPUT_CLIP))
        specs.append(RequestSpec(chat_prompt(tokenizer, template.format(passage)), output_len, 0.0, task))
        about.append({"task": task, "passage": name, "passage_tokens": passage_tokens})
    return specs, about


def chat_pool(tokenizer, rng: np.random.Generator, n: int) -> list[RequestSpec]:
    questions = [template.format(subject) for template in CHAT_TEMPLATES for subject in CHAT_SUBJECTS]
    order = rng.permutation(len(questions))
    return [RequestSpec(chat_prompt(tokenizer, questions[order[i % len(questions)]]), CHAT_OUTPUT_LEN, 0.0, "chat")
            for i in range(n)]


def sharegpt_pool(vocab_size: int, seed: int, n: int) -> list[RequestSpec]:
    args = argparse.Namespace(workload="sharegpt-like", input_len=SHAREGPT_INPUT_MEDIAN,
                              output_len=SHAREGPT_OUTPUT_MEDIAN, num_prompts=n, request_rate=math.inf,
                              vocab_size=vocab_size)
    return build_workload(args, np.random.default_rng(seed))


@dataclass
class Workloads:
    """Per workload, the requests of each streams count, the warm-up and the output check."""

    runs: dict[str, dict[int, list[RequestSpec]]]
    about: dict[str, dict[int, list[dict]]]
    warmup: list[RequestSpec]
    check: list[RequestSpec]
    description: dict


def requests_for(streams: int, args: argparse.Namespace) -> int:
    return max(streams * args.requests_per_stream, args.min_requests)


def build_workloads(args: argparse.Namespace, streams_list: list[int]) -> Workloads:
    from chunkserve.config.model import resolve_model
    from chunkserve.engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(args.model))
    counts = [requests_for(s, args) for s in streams_list]
    extra = max(streams_list) + args.check_outputs  # the warm-up burst and the check: prompts of their own
    passages = stdlib_passages(tokenizer)
    high, high_about = high_overlap_pool(tokenizer, passages, np.random.default_rng([args.seed, 1]),
                                         sum(counts) + extra)
    share = sharegpt_pool(len(tokenizer), args.seed, sum(counts))
    chat = chat_pool(tokenizer, np.random.default_rng([args.seed, 2]), sum(counts))
    runs: dict[str, dict[int, list[RequestSpec]]] = {}
    about: dict[str, dict[int, list[dict]]] = {}
    for name, pool, pool_about in (("high-overlap", high, high_about), ("sharegpt-like", share, None),
                                   ("chat", chat, None)):
        if name not in args.workloads:
            continue
        runs[name], about[name] = {}, {}
        start = 0
        for streams, count in zip(streams_list, counts):
            specs = pool[start:start + count]
            if args.max_output_len:
                for spec in specs:
                    spec.output_len = max(2, min(spec.output_len, args.max_output_len))
            runs[name][streams] = specs
            about[name][streams] = (pool_about[start:start + count] if pool_about else
                                    [{"task": name} for _ in specs])
            start += count
    tail = high[sum(counts):]
    warmup = [RequestSpec(s.prompt_token_ids, WARMUP_OUTPUT_LEN, 0.0, "warmup") for s in tail[:max(streams_list)]]
    check = [RequestSpec(s.prompt_token_ids, CHECK_OUTPUT_LEN, 0.0, "check") for s in tail[max(streams_list):]]
    distinct = {kind: len(items) for kind, items in passages.items()}
    needed = {kind: sum(1 for i in range(len(high)) if TASKS[i % len(TASKS)][1] == kind) for kind in passages}
    for kind in passages:
        per_task = needed[kind] / sum(1 for t in TASKS if t[1] == kind)
        if per_task > distinct[kind]:
            print(f"note: {kind} passages repeat ({distinct[kind]} distinct for {per_task:.0f} requests per task)",
                  file=sys.stderr)
    description = {
        "high-overlap": {"tasks": [{"task": t, "passage": k, "message": m} for t, k, m in TASKS],
                         "stdlib_modules": list(STDLIB_MODULES), "python": platform.python_version(),
                         "passage_tokens": list(PASSAGE_TOKENS), "output_clip": list(OUTPUT_CLIP),
                         "distinct_passages": distinct},
        "sharegpt-like": sharegpt_like_params(SHAREGPT_INPUT_MEDIAN, SHAREGPT_OUTPUT_MEDIAN),
        "chat": {"templates": list(CHAT_TEMPLATES), "subjects": list(CHAT_SUBJECTS), "output_len": CHAT_OUTPUT_LEN},
    }
    return Workloads(runs, about, warmup, check, description)


# ----- servers -------------------------------------------------------------------------------

class Server(Service):
    """One mode's server (the harness's Service, in its own process group: its engine processes
    go with it), with the speculative-decoding counters the runs read."""

    def __init__(self, mode: str, command: list[str], log_path: str, metric_prefix: str,
                 start_timeout_s: float) -> None:
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        super().__init__(command, log_path, env=env, label=mode, start_timeout_s=start_timeout_s)
        self.mode, self.prefix = mode, metric_prefix

    def spec_counters(self) -> dict[str, float]:
        metrics = self.metrics()
        return {key: metrics.get(f"{self.prefix}:spec_decode_num_{key}_total", 0.0)
                for key in ("drafts", "draft_tokens", "accepted_tokens")}

    def settled_counters(self) -> dict[str, float]:
        """The counters once two reads 0.3 s apart agree (a server may count a step after its last token)."""
        last = self.spec_counters()
        for _ in range(10):
            time.sleep(0.3)
            now = self.spec_counters()
            if now == last:
                break
            last = now
        return last


def spec_config(args: argparse.Namespace, policy: str) -> dict:
    return {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max,
            "policy": policy}


def server_command(mode: str, args: argparse.Namespace) -> list[str]:
    """The mode's start command; the harness gives it its port (`--port`, or vLLM's `{port}`)."""
    budget = ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if mode in CHUNKSERVE_MODES:
        command = [sys.executable, "-m", "chunkserve", "serve", "--host", "127.0.0.1", *budget]
        if args.model:
            command += ["--model", args.model]
        if mode != "off":
            command += ["--speculative-config", json.dumps(spec_config(args, mode))]
        return command + args.server_arg
    command = ["bash", args.vllm_script, "{port}", *budget]
    if VLLM_MODES[mode] == "ngram":  # vLLM's n-gram proposer with the same k and lookup bounds
        ngram = {key: value for key, value in spec_config(args, "").items() if key != "policy"}
        command += ["--speculative-config", json.dumps(ngram)]
    return command


def start_mode(mode: str, args: argparse.Namespace, log_path: str) -> Server:
    if mode in CHUNKSERVE_MODES:
        return Server(mode, server_command(mode, args), log_path, "chunkserve", CHUNKSERVE_START_TIMEOUT_S)
    return Server(mode, server_command(mode, args), log_path, "vllm", VLLM_START_TIMEOUT_S)


# ----- runs ----------------------------------------------------------------------------------

def completion(server: Server, spec: RequestSpec) -> str:
    """One greedy, non-streamed answer of exactly spec.output_len tokens: its text."""
    body = {"prompt": spec.prompt_token_ids, "max_tokens": spec.output_len, "min_tokens": spec.output_len,
            "ignore_eos": True, "temperature": 0}
    model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    response = httpx.post(f"{server.url}/v1/completions", json={"model": model, **body}, timeout=1800)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def warm_up(server: Server, workloads: Workloads) -> list[str]:
    """The check prompts one at a time (the first request after start-up is the slow one), then the
    warm-up burst at once: returns the check answers."""
    answers = [completion(server, spec) for spec in workloads.check]
    if not workloads.check:
        completion(server, RequestSpec(workloads.warmup[0].prompt_token_ids, WARMUP_OUTPUT_LEN, 0.0, "warmup"))
    asyncio.run(run_requests(workloads.warmup, server.url, None, None, None))
    return answers


def token_tpot(result: RequestResult) -> float | None:
    """Seconds per output token after the first, counting tokens (not stream events)."""
    times = result.token_times
    if len(times) < 1 or result.completion_tokens < 2:
        return None
    return (times[-1] - times[0]) / (result.completion_tokens - 1)


def measure(server: Server, specs: list[RequestSpec], streams: int) -> tuple[dict, list[RequestResult]]:
    before = server.settled_counters()
    _, _, results = asyncio.run(run_requests(specs, server.url, None, None, streams))
    after = server.settled_counters()
    summary = summarize(results)
    done = [r for r in results if r.ok]
    counts = {key: after[key] - before[key] for key in before}
    tpot = ms_distribution(token_tpot(r) for r in done)
    events = sum(len(r.token_times) for r in done)
    row = {
        "requests": len(results), "failed": summary["failed"], "duration_s": summary["duration_s"],
        "completion_tokens": sum(r.completion_tokens for r in done),
        "output_tok_s": summary["output_token_throughput"],
        "tpot_p50_ms": tpot["p50"], "tpot_p99_ms": tpot["p99"], "ttft_p50_ms": summary["ttft_ms"]["p50"],
        "ttft_p99_ms": summary["ttft_ms"]["p99"],
        "tokens_per_event": sum(r.completion_tokens for r in done) / events if events else None,
        "drafts": counts["drafts"], "draft_tokens": counts["draft_tokens"], "accepted": counts["accepted_tokens"],
        "mean_acceptance_length": 1 + counts["accepted_tokens"] / counts["drafts"] if counts["drafts"] else None,
        "draft_acceptance_rate": counts["accepted_tokens"] / counts["draft_tokens"] if counts["draft_tokens"] else None,
        "short_or_long": sum(1 for r in done if r.completion_tokens != r.output_len),
        "errors": sorted({r.error for r in results if r.error})[:3],
    }
    return row, results


def sanity(row: dict, mode: str, k: int) -> list[str]:
    """What in a run's numbers makes no sense (reported, never fatal)."""
    problems = []
    if row["failed"]:
        problems.append(f"{row['failed']} failed request(s): {row['errors']}")
    if row["short_or_long"]:
        problems.append(f"{row['short_or_long']} request(s) did not return exactly their output length")
    if mode in ("off", "vllm-off") and (row["drafts"] or row["draft_tokens"] or row["accepted"]):
        problems.append("speculation is off, yet the draft counters moved")
    if row["accepted"] > row["draft_tokens"]:
        problems.append(f"more tokens accepted ({row['accepted']:.0f}) than drafted ({row['draft_tokens']:.0f})")
    if row["draft_tokens"] > k * row["drafts"]:
        problems.append(f"{row['draft_tokens']:.0f} draft tokens in {row['drafts']:.0f} drafts of at most {k}")
    if row["drafts"] and row["draft_tokens"] < row["drafts"]:
        problems.append(f"fewer draft tokens ({row['draft_tokens']:.0f}) than drafts ({row['drafts']:.0f})")
    if row["drafts"] and row["drafts"] > row["completion_tokens"]:
        problems.append(f"more drafts ({row['drafts']:.0f}) than output tokens ({row['completion_tokens']})")
    return problems


def schedule(args: argparse.Namespace) -> list[tuple[int, str]]:
    """(round, mode): chunkserve's modes each round, their order reversed every other round, then vLLM's."""
    ours = [m for m in args.modes if m in CHUNKSERVE_MODES]
    theirs = [m for m in args.modes if m in VLLM_MODES]
    plan = []
    for round_index in range(args.rounds):
        plan += [(round_index, m) for m in (ours if round_index % 2 == 0 else ours[::-1])]
    for round_index in range(args.vllm_rounds):
        plan += [(round_index, m) for m in (theirs if round_index % 2 == 0 else theirs[::-1])]
    return plan


# ----- tables --------------------------------------------------------------------------------

def median_rows(rows: list[dict]) -> dict:
    keys = ("output_tok_s", "tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms", "drafts", "draft_tokens", "accepted",
            "mean_acceptance_length", "failed", "tokens_per_event")
    out = {}
    for key in keys:
        values = [r[key] for r in rows if r[key] is not None]
        out[key] = statistics.median(values) if values else None
    out["rounds"] = len(rows)
    return out


def fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def print_tables(medians: dict, args: argparse.Namespace, streams_list: list[int], workloads: Workloads) -> None:
    for workload in args.workloads:
        specs = workloads.runs[workload]
        sizes = [(len(s.prompt_token_ids), s.output_len) for v in specs.values() for s in v]
        print(f"\n**{workload}** (medians of {args.rounds} round(s) for chunkserve, {args.vllm_rounds} for vLLM; "
              f"prompts {statistics.mean(p for p, _ in sizes):.0f} tokens on average, outputs "
              f"{statistics.mean(o for _, o in sizes):.0f})\n")
        header = ("streams", "mode", "out tok/s", "vs own off", "vs chunkserve off", "TPOT p50 ms", "TPOT p99 ms",
                  "TTFT p50 ms", "mean acc. len", "drafts", "accepted / draft tok", "failed")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for streams in streams_list:
            for mode in args.modes:
                row = medians.get((mode, workload, streams))
                if row is None:
                    continue
                own = medians.get(("vllm-off" if mode in VLLM_MODES else "off", workload, streams))
                ours = medians.get(("off", workload, streams))

                def ratio(base: dict | None) -> str:
                    if not base or not base["output_tok_s"]:
                        return "-"
                    return f"{row['output_tok_s'] / base['output_tok_s']:.2f}x"

                speculating = mode not in ("off", "vllm-off")
                print(f"| {streams} | {mode} | {fmt(row['output_tok_s'])} | {ratio(own)} | {ratio(ours)} | "
                      f"{fmt(row['tpot_p50_ms'])} | {fmt(row['tpot_p99_ms'])} | {fmt(row['ttft_p50_ms'], 0)} | "
                      f"{fmt(row['mean_acceptance_length'], 2) if speculating else '-'} | "
                      f"{fmt(row['drafts'], 0) if speculating else '-'} | "
                      + (f"{fmt(row['accepted'], 0)} / {fmt(row['draft_tokens'], 0)}" if speculating else "-")
                      + f" | {fmt(row['failed'], 0)} |")


# ----- main ----------------------------------------------------------------------------------

def csv_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(ALL_MODES), help=f"comma-separated, of {', '.join(ALL_MODES)}")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--streams", default="1,4,8", help="concurrent streams (max in flight), comma-separated")
    parser.add_argument("--requests-per-stream", type=int, default=4)
    parser.add_argument("--min-requests", type=int, default=8, help="at least this many requests per run")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--vllm-rounds", type=int, default=None, help="rounds of the vLLM modes (default --rounds)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-output-len", type=int, default=None, help="cap every request's output (short checks)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=5)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="every server's token budget")
    parser.add_argument("--check-outputs", type=int, default=2,
                        help="high-overlap prompts answered once per server and compared with `off`'s answers")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="an extra flag for every chunkserve server (repeat it; use --server-arg=--flag)")
    parser.add_argument("--vllm-script", default=VLLM_SCRIPT, help="starts vLLM: PORT [vLLM flags...]")
    parser.add_argument("--model", default=None,
                        help="chunkserve's model and the prompts' tokenizer (default: the default model; vLLM serves "
                             "its own, benchmarks/peers/)")
    parser.add_argument("--dry-run", action="store_true",
                        help="build the workloads, print the plan and the servers' commands; start no server")
    parser.add_argument("--workdir", default=None, help="the servers' log (default: a temp dir)")
    parser.add_argument("--save-requests", action="store_true", help="keep every request's timings in --out")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    args.modes = csv_list(args.modes)
    args.workloads = csv_list(args.workloads)
    unknown = [m for m in args.modes if m not in ALL_MODES] + [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown mode(s)/workload(s): {unknown}")
    if args.vllm_rounds is None:
        args.vllm_rounds = args.rounds
    return args


def dry_run(workloads: Workloads, plan: list[tuple[int, str]], args: argparse.Namespace) -> None:
    """What a run would do: the workloads' sizes and each round's server command."""
    for name, runs in workloads.runs.items():
        print(f"{name}: " + ", ".join(f"{streams} streams: {len(specs)} requests, prompts "
                                      f"{statistics.mean(len(s.prompt_token_ids) for s in specs):.0f} tokens"
                                      for streams, specs in runs.items()))
    for round_index, mode in plan:
        print(f"round {round_index + 1}: {mode}: {' '.join(server_command(mode, args))}")


@dataclass
class Collected:
    """Everything a run gathers, kept when it is interrupted so the report covers what finished."""

    results: list[dict] = field(default_factory=list)
    servers: list[dict] = field(default_factory=list)
    answers: dict[tuple[str, int], list[str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    interrupted: bool = False


def run_plan(plan: list[tuple[int, str]], workloads: Workloads, args: argparse.Namespace, log_path: str,
             out: Collected, bar: tqdm) -> None:
    """Every round of the plan, one server at a time; Ctrl-C ends it early (out.interrupted)."""
    try:
        for round_index, mode in plan:
            bar.set_description(f"round {round_index + 1}: starting {mode}")
            server = start_mode(mode, args, log_path)
            try:
                measure_server(server, mode, round_index, workloads, args, out, bar)
            finally:
                server.stop(wait_port=True)
    except KeyboardInterrupt:  # report what finished (the servers are stopped by then)
        out.interrupted = True
    finally:
        bar.close()
        stop_all()


def measure_server(server: Server, mode: str, round_index: int, workloads: Workloads, args: argparse.Namespace,
                   out: Collected, bar: tqdm) -> None:
    """One started server's round: the warm-up (which answers the check prompts), then every
    workload at every stream count."""
    start_s = server.wait_healthy()
    bar.set_description(f"round {round_index + 1}: {mode} warm-up")
    warm_start = time.monotonic()
    out.answers[(mode, round_index)] = warm_up(server, workloads)
    out.servers.append({"mode": mode, "round": round_index, "start_s": start_s,
                        "warmup_s": time.monotonic() - warm_start})
    for workload in args.workloads:
        for streams, specs in workloads.runs[workload].items():
            bar.set_description(f"round {round_index + 1}: {mode} {workload} x{streams}")
            row, requests = measure(server, specs, streams)
            row.update({"mode": mode, "round": round_index, "workload": workload, "streams": streams})
            for problem in sanity(row, mode, args.num_speculative_tokens):
                message = f"{mode} {workload} x{streams} round {round_index + 1}: {problem}"
                out.problems.append(message)
                tqdm.write("warning: " + message, file=sys.stderr)
            if args.save_requests:
                row["per_request"] = [{**r.to_dict(), **about} for r, about in
                                      zip(requests, workloads.about[workload][streams])]
            out.results.append(row)
            bar.update()


def medians_by_run(results: list[dict]) -> dict[tuple[str, str, int], dict]:
    """(mode, workload, streams) -> the median over its rounds."""
    groups: dict[tuple[str, str, int], list[dict]] = {}
    for row in results:
        groups.setdefault((row["mode"], row["workload"], row["streams"]), []).append(row)
    return {key: median_rows(rows) for key, rows in groups.items()}


def answers_same_as_off(answers: dict[tuple[str, int], list[str]]) -> dict[str, list[str]]:
    """Per mode and round, how many greedy check answers match the same system's `off` answers
    (speculation must not change a greedy answer)."""
    same_as_off: dict[str, list[str]] = {}
    for (mode, round_index), texts in answers.items():
        base_mode = "vllm-off" if mode in VLLM_MODES else "off"
        base = [t for (m, _), t in answers.items() if m == base_mode]
        if mode != base_mode and base and texts:
            same = sum(any(a == b[i] for b in base) for i, a in enumerate(texts))
            same_as_off.setdefault(mode, []).append(f"{same}/{len(texts)}")
    return same_as_off


def write_results(args: argparse.Namespace, streams_list: list[int], host: dict, workloads: Workloads,
                  medians: dict, same_as_off: dict, out: Collected) -> None:
    config = {k: v for k, v in vars(args).items()}
    config["streams"] = streams_list
    config["requests_per_run"] = {str(s): requests_for(s, args) for s in streams_list}
    config["speculative_config"] = {m: spec_config(args, m) for m in ("always", "auto")}
    with open(args.out, "w") as f:
        json.dump({"machine": host, "config": config, "workloads": workloads.description,
                   "medians": [{"mode": m, "workload": w, "streams": s, **row} for (m, w, s), row in medians.items()],
                   "results": out.results, "servers": out.servers,
                   "check_answers": [{"mode": m, "round": r, "answers": t} for (m, r), t in out.answers.items()],
                   "same_as_off": same_as_off, "problems": out.problems, "interrupted": out.interrupted}, f,
                  indent=1)
    print(f"\nwrote {args.out}", file=sys.stderr)


def main() -> None:
    args = parse_args()
    streams_list = [int(s) for s in csv_list(args.streams)]
    if any(m in VLLM_MODES for m in args.modes) and (missing := peer_missing(args.vllm_script)):
        print(f"skipping {', '.join(m for m in args.modes if m in VLLM_MODES)}: {missing}", file=sys.stderr)
        args.modes = [m for m in args.modes if m not in VLLM_MODES]
    workdir = args.workdir or ("(none: --dry-run)" if args.dry_run
                               else tempfile.mkdtemp(prefix="spec-decode-bench-"))
    if not args.dry_run:
        os.makedirs(workdir, exist_ok=True)
    log_path = os.path.join(workdir, "servers.log")

    workloads = build_workloads(args, streams_list)
    plan = schedule(args)
    host = machine()
    print(f"{host['cpu']}, {host['cpus']} cores, AVX-512: {host['avx512_flags'] or 'none'}, commit {host['commit']}; "
          f"server logs in {log_path}", file=sys.stderr)

    if args.dry_run:
        dry_run(workloads, plan, args)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs run_plan's finally (and the harness's atexit)
    out = Collected()
    bar = tqdm(total=len(plan) * sum(len(workloads.runs[w]) for w in args.workloads), unit="run")
    run_plan(plan, workloads, args, log_path, out, bar)
    if out.interrupted:
        print(f"\ninterrupted: {len(out.results)} of {bar.total} runs finished; reporting those", file=sys.stderr)

    medians = medians_by_run(out.results)
    print(f"\n{host['cpu']}, {host['cpus']} cores, AVX-512: {host['avx512_flags'] or 'none'}, commit {host['commit']}")
    print(f"ngram k={args.num_speculative_tokens}, lookup {args.prompt_lookup_min}..{args.prompt_lookup_max}, "
          f"--max-num-batched-tokens {args.max_num_batched_tokens}; streams = requests in flight; TPOT over tokens")
    print_tables(medians, args, streams_list, workloads)
    same_as_off = answers_same_as_off(out.answers)
    if same_as_off:
        print(f"\ngreedy answers ({CHECK_OUTPUT_LEN} tokens) identical to the same system's off, per round: "
              + "; ".join(f"{mode} {', '.join(v)}" for mode, v in same_as_off.items()))
    if out.problems:
        print("\nnumbers that make no sense:\n" + "\n".join(f"- {p}" for p in out.problems))
    if args.out:
        write_results(args, streams_list, host, workloads, medians, same_as_off, out)
    if out.interrupted:
        sys.exit(130)


if __name__ == "__main__":
    main()

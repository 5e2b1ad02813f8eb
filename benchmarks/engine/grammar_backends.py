"""Grammar backends for structured outputs, measured: llguidance, xgrammar and outlines-core.

Structured outputs constrain each decode step with a per-request token bitmask (one bit per
vocabulary entry, int32 words) that a grammar matcher fills before sampling and advances after.
This script measures, for the default model's tokenizer (SmolLM2-135M-Instruct, vocab 49152), what
each library costs at each point of that loop, on the CPU, in one process:

* Setup: the backend's tokenizer object from the HF tokenizer (`llguidance.hf.from_tokenizer`,
  `xgrammar.TokenizerInfo.from_huggingface` + `GrammarCompiler`, `outlines_core.Vocabulary` built
  from the byte-level-decoded vocabulary, special tokens left out as vLLM does), first and median.
* Compile, per workload (`WORKLOADS`): the first compile in the process; the median over
  `--compile-reps` variants the library has not seen (a different "title", an extra regex group,
  a rotated choice list, a Lark comment), each after emptying xgrammar's compile cache (it keys
  on the parsed grammar, so such variants alone hit it); and the first spec again ("cached":
  only xgrammar's GrammarCompiler caches, the others compile it afresh). Repetitions stop once
  `--compile-budget-s` is spent (n= says how many ran). Compile is what vLLM's backends do per
  request: llguidance builds the grammar string and an `LLMatcher` (its lexer is built lazily,
  so part of its compile lands on the first masks), xgrammar `GrammarCompiler.compile_*`,
  outlines-core `Index(regex, vocabulary)` (JSON schemas through `build_regex_from_schema`;
  json_object as the schema {"type": "object"}, a regex nesting 3 levels at most).
* A walk, `--walks` seeded ones per workload: a fresh matcher (TTFM: matcher creation + first
  mask), then per step fill the bitmask (timed), pick a token at random among the allowed ones,
  advance (timed), until EOS or `--max-tokens`. EOS, when allowed, is taken with probability
  `--p-eos`; otherwise, with probability `--p-close`, it picks one of the closing characters
  (`CLOSERS`: quote, brace, bracket, parenthesis, '@') that some allowed token contains, then
  one of those tokens, so strings, objects and emails end and walks complete. JSON is compact
  (no flexible whitespace) for every backend.
* Correctness of completed walks: JSON schemas validate with `jsonschema` (when importable),
  json_object parses to a dict, regexes `re.fullmatch`, choices are one of the choices, the
  arithmetic grammar parses with `ast` (a loose check).
* Rollback, as speculative decoding needs it: on a fresh matcher that consumed a walk's tokens,
  roll back k = 1, 2, 4 tokens, check the mask equals the one recorded at that point, re-advance
  and check the final mask again.
* Applying a bitmask to float32 logits (1 and 8 rows of 49152): `llguidance.torch`'s
  torch.compile'd kernel (its first calls compile it, into an empty inductor cache directory
  under /tmp, as on a fresh host), xgrammar's native CPU kernel, and a plain
  torch unpack + `masked_fill_` (what a wrapper without a library kernel would do; used for
  outlines-core, whose own kernel is torch.compile'd like llguidance's). torch runs on
  `--torch-threads` (1: on a busy 2-core host, 2 threads made each apply many times slower;
  docs/benchmarks-log.md, "Costs behind choices in the code").

The libraries need not be installed in the venv:

    PYTHONPATH=/tmp/glibs .venv/bin/python -m benchmarks.engine.grammar_backends [--walks 10]

(about 2 minutes on a 2-core machine, most of it torch.compile of llguidance's kernel).

    .venv/bin/python -m benchmarks.engine.grammar_backends --smoke --model TINY_MODEL   # seconds: does it run?

(`--smoke`: the installed backends only, one workload, one short walk, no apply table.)
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import json
import re
import statistics
import os
import subprocess
import tempfile
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from chunkserve.config.model import resolve_model
from chunkserve.engine.tokenizer import load_tokenizer
from benchmarks.support import (  # benchmarks/support.py
    EMAIL_REGEX, NESTED_SCHEMA, SMALL_SCHEMA, TOOL_SCHEMA, add_model_flag, add_smoke_flag)

DATETIME_REGEX = (
    r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])T([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9]"
    r"(\.[0-9]{1,3})?(Z|[+-][0-9]{2}:[0-9]{2})"
)
CHOICES = ["positive", "negative", "neutral", "mixed", "unknown"]
ARITHMETIC_LARK = """start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[1-9][0-9]{0,5}/
"""
WORKLOADS: dict[str, tuple[str, Any]] = {
    "json small": ("json", SMALL_SCHEMA),
    "json nested": ("json", NESTED_SCHEMA),
    "json tool-call": ("json", TOOL_SCHEMA),
    "json_object": ("json_object", {"type": "object"}),
    "regex email": ("regex", EMAIL_REGEX),
    "regex date-time": ("regex", DATETIME_REGEX),
    "choice (5)": ("choice", CHOICES),
    "lark arithmetic": ("lark", ARITHMETIC_LARK),
}
CLOSERS = '"}])@'
ROLLBACK_KS = (1, 2, 4)


class Unsupported(Exception):
    """The backend has no way to express this workload."""


def variant(kind: str, spec: Any, i: int) -> Any:
    """The i-th spec equivalent to `spec` that a compile cache has not seen (i = 0: `spec`)."""
    if i == 0:
        return spec
    if kind in ("json", "json_object"):
        return {**spec, "title": f"variant {i}"}
    if kind == "regex":
        return "(" * i + spec + ")" * i
    if kind == "choice":
        return spec[i % len(spec):] + spec[:i % len(spec)]
    return f"// variant {i}\n{spec}"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte value -> the character standing for it in the vocab."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)}
    chars: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def token_bytes(tokenizer: Any) -> list[bytes | None]:
    """Each token id's bytes (byte-level BPE decoded); None for special tokens."""
    decoder = {c: b for b, c in bytes_to_unicode().items()}
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    table: list[bytes | None] = [None] * len(tokenizer)
    for text, token_id in tokenizer.get_vocab().items():
        if token_id not in special:
            table[token_id] = bytes(decoder[c] for c in text)
    return table


class Backend(ABC):
    """One grammar library behind the calls a structured-output wrapper makes."""

    name: str
    dist: str
    modules: tuple[str, ...]
    apply_kernel: str

    @abstractmethod
    def __init__(self, tokenizer: Any) -> None:
        """Builds the library's tokenizer object (timed as setup)."""

    @abstractmethod
    def compile(self, kind: str, spec: Any) -> Any:
        """The compiled grammar for one request; raises Unsupported."""

    def clear_cache(self) -> None:
        """Empties the library's compile cache, where it has one."""

    @abstractmethod
    def matcher(self, compiled: Any) -> Any:
        """A fresh matcher at the start of the grammar."""

    @abstractmethod
    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        """Writes the allowed-token bitmask into row 0 of `bitmask`."""

    @abstractmethod
    def advance(self, matcher: Any, token: int) -> bool:
        """Consumes one token (EOS included); False if the grammar rejects it."""

    @abstractmethod
    def rollback(self, matcher: Any, k: int) -> None:
        """Undoes the last k consumed tokens."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """Sets the logits of disallowed tokens to -inf, in place."""


class LLGuidance(Backend):
    """llguidance: an LLMatcher per request, over the grammar string llguidance builds."""

    name, dist, apply_kernel = "llguidance", "llguidance", "llguidance.torch (torch.compile)"
    modules = ("llguidance", "llguidance.hf", "llguidance.torch")

    def __init__(self, tokenizer: Any) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg, self.llg_torch = llguidance, llguidance.torch
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer)

    def compile(self, kind: str, spec: Any) -> str:
        LLMatcher = self.llg.LLMatcher
        if kind in ("json", "json_object"):
            grammar = LLMatcher.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False})
        elif kind == "regex":
            grammar = LLMatcher.grammar_from_regex(spec)
        elif kind == "choice":
            grammar = self.llg.grammar_from("choice", json.dumps(spec))
        else:
            grammar = LLMatcher.grammar_from_lark(spec)
        self.matcher(grammar)  # what vLLM's compile does: the matcher is where the grammar is built
        return grammar

    def matcher(self, compiled: str) -> Any:
        matcher = self.llg.LLMatcher(self.tokenizer, compiled, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        self.llg_torch.fill_next_token_bitmask(matcher, bitmask, 0)

    def advance(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def rollback(self, matcher: Any, k: int) -> None:
        if not matcher.rollback(k):
            raise RuntimeError(matcher.get_error())

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.llg_torch.apply_token_bitmask_inplace(logits, bitmask)


class XGrammar(Backend):
    """xgrammar: a cached GrammarCompiler per tokenizer, a GrammarMatcher per request."""

    name, dist, apply_kernel = "xgrammar", "xgrammar", "xgrammar native CPU"
    modules = ("xgrammar",)

    def __init__(self, tokenizer: Any) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=8, cache_enabled=True)

    def compile(self, kind: str, spec: Any) -> Any:
        if kind in ("json", "json_object"):
            return self.compiler.compile_json_schema(json.dumps(spec), any_whitespace=False,
                                                     separators=(",", ":"))
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        if kind == "choice":  # as vLLM does: an EBNF alternation of string literals
            return self.compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec))
        return self.compiler.compile_lark(spec)

    def clear_cache(self) -> None:
        self.compiler.clear_cache()

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def advance(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def rollback(self, matcher: Any, k: int) -> None:
        matcher.rollback(k)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        self.xgr.apply_token_bitmask_inplace(logits, bitmask)


class OutlinesCore(Backend):
    """outlines-core: everything as a regex, compiled to an Index; a Guide per request."""

    name, dist, apply_kernel = "outlines-core", "outlines_core", "torch unpack + masked_fill_"
    modules = ("outlines_core", "outlines_core.json_schema")

    def __init__(self, tokenizer: Any) -> None:
        import outlines_core
        import outlines_core.json_schema

        self.oc, self.json_schema = outlines_core, outlines_core.json_schema
        self.eos = tokenizer.eos_token_id
        by_bytes: dict[bytes, list[int]] = {}
        for token_id, data in enumerate(token_bytes(tokenizer)):
            if data is not None and token_id != self.eos:
                by_bytes.setdefault(data, []).append(token_id)
        self.vocabulary = outlines_core.Vocabulary(self.eos, by_bytes)

    def compile(self, kind: str, spec: Any) -> Any:
        if kind in ("json", "json_object"):
            regex = self.json_schema.build_regex_from_schema(json.dumps(spec), whitespace_pattern="")
        elif kind == "regex":
            regex = spec
        elif kind == "choice":
            regex = "(" + "|".join(re.escape(c) for c in spec) + ")"
        else:
            raise Unsupported("no context-free grammars")
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled, max_rollback=32)

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        row = bitmask[0]
        matcher.write_mask_into(row.data_ptr(), row.numel(), row.element_size())

    def advance(self, matcher: Any, token: int) -> bool:
        if token == self.eos:  # a Guide never advances on EOS: it is allowed in final states
            return matcher.is_finished()
        try:
            matcher.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def rollback(self, matcher: Any, k: int) -> None:
        matcher.rollback_state(k)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        apply_unpacked(logits, bitmask)


BACKENDS: dict[str, type[Backend]] = {b.name: b for b in (LLGuidance, XGrammar, OutlinesCore)}
_BITS = torch.arange(32, dtype=torch.int32)


def apply_unpacked(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Plain-torch bitmask application: unpack the int32 words to booleans, fill -inf."""
    allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).bool().view(bitmask.shape[0], -1)
    logits.masked_fill_(~allowed[:, : logits.shape[1]], float("-inf"))


def allowed_ids(bitmask: torch.Tensor, vocab: int) -> np.ndarray:
    """The token ids whose bit is set in row 0 of `bitmask`."""
    bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


@dataclass
class Walk:
    """One seeded walk: its tokens, per-step timings (ns) and the mask before each step."""

    tokens: list[int] = field(default_factory=list)
    first_mask_ns: int = 0
    fill_ns: list[int] = field(default_factory=list)
    advance_ns: list[int] = field(default_factory=list)
    masks: list[torch.Tensor] = field(default_factory=list)
    completed: bool = False
    error: str = ""


def closer_table(table: list[bytes | None]) -> np.ndarray:
    """Row c, column t: whether token t's bytes contain the closing character CLOSERS[c]."""
    return np.array([[t is not None and c.encode() in t for t in table] for c in CLOSERS])


def walk(backend: Backend, compiled: Any, seed: int, eos: int, closer: np.ndarray,
         args: argparse.Namespace) -> Walk:
    """Generates up to --max-tokens tokens at random under the grammar, timing each call."""
    rng = np.random.default_rng(seed)
    vocab = closer.shape[1]
    bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    result = Walk()
    start = time.perf_counter_ns()
    matcher = backend.matcher(compiled)
    for step in range(args.max_tokens + 1):
        t0 = time.perf_counter_ns()
        backend.fill(matcher, bitmask)
        t1 = time.perf_counter_ns()
        if step == 0:
            result.first_mask_ns = t1 - start
        else:
            result.fill_ns.append(t1 - t0)
        result.masks.append(bitmask.clone())
        if step == args.max_tokens:
            break
        allowed = allowed_ids(bitmask, vocab)
        if allowed.size == 0:
            result.error = "empty mask"
            break
        is_eos = allowed == eos
        if is_eos.any() and (allowed.size == 1 or rng.random() < args.p_eos):
            token = eos
        else:
            allowed = allowed[~is_eos]
            pools = [pool for pool in (allowed[has] for has in closer[:, allowed]) if pool.size]
            if pools and rng.random() < args.p_close:
                allowed = pools[rng.integers(len(pools))]
            token = int(rng.choice(allowed))
        t0 = time.perf_counter_ns()
        ok = backend.advance(matcher, token)
        result.advance_ns.append(time.perf_counter_ns() - t0)
        if not ok:
            result.error = f"token {token} rejected"
            break
        if token == eos:
            result.completed = True
            break
        result.tokens.append(token)
    return result


def check_rollback(backend: Backend, compiled: Any, run: Walk, vocab: int) -> tuple[bool, list[int]]:
    """Rolls a replayed walk back k tokens: same mask as recorded? same again after re-advancing?"""
    n = len(run.tokens)
    matcher = backend.matcher(compiled)
    for token in run.tokens:
        backend.advance(matcher, token)
    bitmask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    ok, times = True, []
    for k in ROLLBACK_KS:
        if k > n:
            break
        t0 = time.perf_counter_ns()
        backend.rollback(matcher, k)
        times.append(time.perf_counter_ns() - t0)
        backend.fill(matcher, bitmask)
        ok &= torch.equal(bitmask, run.masks[n - k])
        for token in run.tokens[n - k:]:
            ok &= backend.advance(matcher, token)
        backend.fill(matcher, bitmask)
        ok &= torch.equal(bitmask, run.masks[n])
    return ok, times


def validator(kind: str, spec: Any) -> Callable[[str], bool] | None:
    """A check of a completed walk's text, or None where none is available."""
    if kind == "json":
        if importlib.util.find_spec("jsonschema") is None:
            return None
        import jsonschema

        checker = jsonschema.Draft202012Validator(spec)
        return lambda text: checker.is_valid(json.loads(text))
    if kind == "json_object":
        return lambda text: isinstance(json.loads(text), dict)
    if kind == "regex":
        pattern = re.compile(spec)
        return lambda text: pattern.fullmatch(text) is not None
    if kind == "choice":
        return lambda text: text in spec
    return lambda text: isinstance(ast.parse(text, mode="eval"), ast.Expression)


def is_valid(check: Callable[[str], bool], run: Walk, table: list[bytes | None]) -> bool:
    """Whether the walk's bytes decode as UTF-8 and pass `check`."""
    try:
        return check(b"".join(table[t] or b"" for t in run.tokens).decode("utf-8"))
    except (ValueError, SyntaxError):
        return False


def ms(ns: float) -> str:
    """Nanoseconds as milliseconds."""
    return f"{ns / 1e6:.2f}"


def us(ns: float) -> str:
    """Nanoseconds as microseconds."""
    return f"{ns / 1e3:.1f}"


def timed_compiles(backend: Backend, kind: str, specs: Callable[[int], Any], cold: bool,
                   args: argparse.Namespace) -> tuple[list[int], Any]:
    """Compiles specs(0), specs(1), ... (up to --compile-reps, while within --compile-budget-s),
    each after emptying the compile cache if `cold`: the times in ns, the last compiled grammar."""
    times: list[int] = []
    while len(times) < args.compile_reps and sum(times) < args.compile_budget_s * 1e9:
        if cold:
            backend.clear_cache()
        t0 = time.perf_counter_ns()
        compiled = backend.compile(kind, specs(len(times)))
        times.append(time.perf_counter_ns() - t0)
    return times, compiled


def median_ms(times: list[int], reps: int) -> str:
    """The median in ms, with the sample count where the budget cut it short."""
    return ms(statistics.median(times)) + ("" if len(times) == reps else f" (n={len(times)})")


def compile_row(backend: Backend, name: str, kind: str, spec: Any, table: list[bytes | None],
                eos: int, closer: np.ndarray, args: argparse.Namespace) -> tuple[str, list[str]]:
    """One markdown row (compile times, walk timings, correctness, rollback for a workload) and
    the texts of the completed walks that failed validation."""
    try:
        cold, _ = timed_compiles(backend, kind, lambda i: variant(kind, spec, i), True, args)
        cached, compiled = timed_compiles(backend, kind, lambda i: spec, False, args)
    except Unsupported as e:
        return f"| {name} | {backend.name} | unsupported ({e}) |" + " |" * 10, []
    except Exception as e:  # a library rejecting the spec is a result, not a crash
        return f"| {name} | {backend.name} | error: {str(e).splitlines()[0][:60]} |" + " |" * 10, []
    runs = [walk(backend, compiled, seed, eos, closer, args) for seed in range(args.walks)]
    check = validator(kind, spec)
    completed = [r for r in runs if r.completed]
    invalid = [] if check is None else [r for r in completed if not is_valid(check, r, table)]
    valid = "n/a" if check is None else str(len(completed) - len(invalid))
    rollbacks = [check_rollback(backend, compiled, r, closer.shape[1]) for r in runs if r.tokens]
    rollback_ok = "ok" if all(ok for ok, _ in rollbacks) else "FAIL"
    rollback_ns = [t for _, ts in rollbacks for t in ts]
    fills = sorted(t for r in runs for t in r.fill_ns)
    advances = [t for r in runs for t in r.advance_ns]
    errors = {r.error for r in runs if r.error}
    texts = [b"".join(table[t] or b"" for t in r.tokens).decode("utf-8", "replace") for r in invalid]
    return (f"| {name} | {backend.name} | {ms(cold[0])} | {median_ms(cold, args.compile_reps)} "
            f"| {median_ms(cached, args.compile_reps)} "
            f"| {ms(statistics.median(r.first_mask_ns for r in runs))} "
            f"| {us(statistics.median(fills))} | {us(fills[int(0.99 * (len(fills) - 1))])} "
            f"| {us(statistics.median(advances))} "
            f"| {statistics.mean(len(r.tokens) for r in runs):.0f} | {len(completed)}/{len(runs)} "
            f"| {valid}/{len(completed)}{' ' + '; '.join(sorted(errors)) if errors else ''} "
            f"| {rollback_ok} {us(statistics.median(rollback_ns)) if rollback_ns else ''} |"), texts


def apply_times(backend: Backend, mask: torch.Tensor, repeats: int) -> tuple[float, float, float]:
    """Seconds of the first calls (both shapes), then median microseconds for 1 and 8 rows."""
    vocab = mask.shape[1] * 32
    shapes = [(torch.randn(rows, vocab), mask.repeat(rows, 1).contiguous()) for rows in (1, 8)]
    t0 = time.perf_counter()
    for logits, bitmask in shapes:
        backend.apply(logits, bitmask)
    first = time.perf_counter() - t0
    medians = []
    for logits, bitmask in shapes:
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            backend.apply(logits, bitmask)
            samples.append(time.perf_counter_ns() - t0)
        medians.append(statistics.median(samples) / 1e3)
    return first, medians[0], medians[1]


def cpu_line() -> str:
    """The CPU model and whether it has AVX-512, from lscpu."""
    info = dict(line.split(":", 1) for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if ":" in line)
    flags = info.get("Flags", "").split()
    return (f"CPU: {info.get('Model name', '?').strip()}; avx512: "
            f"{'yes' if any(f.startswith('avx512') for f in flags) else 'no'}, "
            f"avx2: {'yes' if 'avx2' in flags else 'no'}; torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--walks", type=int, default=10, help="seeded walks per workload")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--compile-reps", type=int, default=3,
                        help="uncached variants compiled, and cached compiles")
    parser.add_argument("--compile-budget-s", type=float, default=5.0,
                        help="no further compile repetitions once this much time is spent")
    parser.add_argument("--setup-reps", type=int, default=3)
    parser.add_argument("--apply-repeats", type=int, default=50)
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch threads (1: on an oversubscribed 2-core host, more threads made "
                             "each bitmask apply many times slower)")
    parser.add_argument("--p-eos", type=float, default=0.5, help="chance to take EOS when allowed")
    parser.add_argument("--p-close", type=float, default=0.8,
                        help="chance to pick among allowed tokens containing a closing character")
    parser.add_argument("--show-invalid", action="store_true",
                        help="print the completed walks that failed validation")
    add_model_flag(parser)
    add_smoke_flag(parser, "the installed backends, one workload, one 8-token walk, no apply table (seconds): "
                   "does it run?")
    args = parser.parse_args()
    if args.smoke:
        args.backends = [name for name in args.backends
                         if importlib.util.find_spec(BACKENDS[name].modules[0]) is not None]
        args.workloads, args.walks, args.max_tokens = ["json small"], 1, 8
        args.compile_reps, args.setup_reps, args.compile_budget_s = 1, 1, 1.0
    return args


def set_up_backends(names: list[str], tokenizer: Any, setup_reps: int) -> list[Backend]:
    """Each backend imported and set up for the tokenizer, timed, with its version and licence
    (a table); the last setup of each is the one measured further."""
    print("| backend | version | license | import (s) | setup first (s) | setup median (s) |")
    print("|---|---|---|---|---|---|")
    backends: list[Backend] = []
    for name in names:
        cls = BACKENDS[name]
        imports = []
        for module in cls.modules:
            t0 = time.perf_counter()
            importlib.import_module(module)
            imports.append(f"{module} {time.perf_counter() - t0:.2f}")
        setups = []
        for _ in range(setup_reps):
            t0 = time.perf_counter()
            backend = cls(tokenizer)
            setups.append(time.perf_counter() - t0)
        backends.append(backend)
        dist = importlib.metadata.metadata(cls.dist)
        license_ = dist.get("License-Expression") or dist.get("License") or "?"
        print(f"| {name} | {dist['Version']} | {license_} | {', '.join(imports)} | {setups[0]:.3f} "
              f"| {statistics.median(setups):.3f} |")
    return backends


def print_compile_table(backends: list[Backend], table: list[bytes | None], eos: int, closer: np.ndarray,
                        args: argparse.Namespace) -> list[str]:
    """A row per workload and backend; returns the completed walks that failed validation."""
    print("\n| workload | backend | compile first (ms) | compile cold p50 (ms) | cached (ms) "
          "| TTFM (ms) | mask p50 (µs) | mask p99 (µs) | advance p50 (µs) | tokens/walk "
          "| completed | valid | rollback k=1,2,4 (p50 µs) |")
    print("|---" * 13 + "|")
    invalid: list[str] = []
    for workload in args.workloads:
        kind, spec = WORKLOADS[workload]
        for backend in backends:
            row, texts = compile_row(backend, workload, kind, spec, table, eos, closer, args)
            print(row, flush=True)
            invalid += [f"{workload} / {backend.name}: {text!r}" for text in texts]
    return invalid


def print_apply_table(backends: list[Backend], eos: int, closer: np.ndarray, args: argparse.Namespace) -> None:
    """Each backend's bitmask apply on one real mask (from the first backend's walk)."""
    print("\n| backend | apply kernel (float32 logits, 49152) | first calls (s) | 1 row (µs) "
          "| 8 rows (µs) |")
    print("|---|---|---|---|---|")
    mask = walk(backends[0], backends[0].compile("json", SMALL_SCHEMA), 0, eos, closer, args).masks[0]
    for backend in backends:
        first, one, eight = apply_times(backend, mask, args.apply_repeats)
        print(f"| {backend.name} | {backend.apply_kernel} | {first:.2f} | {one:.1f} | {eight:.1f} |",
              flush=True)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.torch_threads)
    # an empty inductor cache, so llguidance's kernel compiles as on a fresh host
    inductor_cache = tempfile.TemporaryDirectory(prefix="grammar_backends_inductor_")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache.name

    tokenizer = load_tokenizer(resolve_model(args.model))
    table = token_bytes(tokenizer)
    closer = closer_table(table)
    eos = tokenizer.eos_token_id
    print(cpu_line())
    print(f"tokenizer: {tokenizer.name_or_path}, vocab {len(tokenizer)}, EOS {eos}; "
          f"triton importable: {importlib.util.find_spec('triton') is not None}; "
          f"jsonschema importable: {importlib.util.find_spec('jsonschema') is not None}\n")

    backends = set_up_backends(args.backends, tokenizer, args.setup_reps)
    invalid = print_compile_table(backends, table, eos, closer, args)
    if args.smoke:  # the apply kernels' first calls compile for minutes
        print("\napply kernels: not measured in --smoke")
        return
    print_apply_table(backends, eos, closer, args)
    if args.show_invalid and invalid:
        print("\nCompleted walks that failed validation:\n" + "\n".join(invalid))


if __name__ == "__main__":
    main()

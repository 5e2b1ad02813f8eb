"""Engine speed: chunkserve next to Hugging Face transformers on the default model.

Both run the default model (SmolLM2-135M-Instruct GGUF, dequantized to float32) on the CPU in
the same process, with torch's default thread count. Prompts are random token ids (seeded).

What is measured
----------------
* Prefill tokens/s for one `--prefill-len` prompt.
  chunkserve: `generate(..., max_tokens=1)`; the time is the summed duration of the engine
  steps (from the step records) that processed prompt tokens: one step with chunked prefill
  off, several with chunked prefill at a 512-token budget.
  transformers: one forward over the whole prompt with `logits_to_keep=1` under
  `torch.inference_mode()`.
  Each side runs one untimed warm-up, then `--repeats` timed runs; the median is reported.
* Prefill efficiency (issue 5, target 3): the prefill's useful FLOPs (every linear layer,
  causal attention counted as half the square, the LM head for the one sampled row) over its
  time, against the fp32 GEMM peak measured right before it (`torch.mm` of two 2048 x 2048
  matrices, the best of 3): each timed prefill run gets its own peak, and the median of the
  ratios is reported (this host's speed drifts by 1.5x within minutes); and the chunked
  prefill's time over the unchunked one.
* Decode tokens/s at each batch size of `--decode-batches` (64-token prompts,
  `--decode-steps` output tokens, EOS ignored); tokens/s = batch / median decode-step time.
  chunkserve: the median duration of the pure-DECODE steps with the whole batch running
  (512-token budget). transformers: `model.generate` with `min_new_tokens=max_new_tokens`; a
  stopping criterion timestamps every generated token, and the step time is the median gap
  between consecutive timestamps (prefill excluded).
* Long-prompt interference (chunkserve only): 8 requests decode (64-token prompts, 256 output
  tokens) and, after 10 engine steps, a `--prefill-len` prompt arrives (16 output tokens). The
  gaps between consecutive output tokens of the 8 decoders (their `metrics.token_times`) are
  summarized as p50 / p99 / max, with chunked prefill off and at each of `--chunk-budgets`;
  the long prompt's time to first token is reported too.

Run it with

    .venv/bin/python -m benchmarks.engine.engine_speed
    .venv/bin/python -m benchmarks.engine.engine_speed --skip-transformers --json speed.json
    .venv/bin/python -m benchmarks.engine.engine_speed --smoke --model TINY_MODEL   # seconds: does it run?

(a full run takes several minutes on a 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import transformers
from benchmarks.support import add_model_flag, add_smoke_flag, gemm_peak_gflop_s  # benchmarks/support.py
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

from chunkserve import LLM, RequestOutput, SamplingParams
from chunkserve.config.model import resolve_model
from chunkserve.core.messages import ForwardMode
from chunkserve.model.config import ModelConfig

TOKEN_ID_RANGE = (100, 40000)
SEED = 0
KV_CACHE_GB = 1.0  # per engine; engines are loaded one at a time
PREFILL_CHUNK_BUDGET = 512
DECODE_PROMPT_LEN = 64
WARMUP_PROMPT_LEN = 64
WARMUP_OUTPUT_LEN = 4
INTERFERENCE_DECODERS = 8
INTERFERENCE_PROMPT_LEN = 64
INTERFERENCE_OUTPUT_LEN = 256
INTERFERENCE_LONG_OUTPUT_LEN = 16
STEPS_BEFORE_LONG_PROMPT = 10


@dataclass(frozen=True)
class EngineJob:
    """One chunkserve configuration and the measurements taken on it."""

    label: str
    engine_args: dict[str, Any]
    prefill: bool
    decode: bool
    interference: bool


@dataclass
class Results:
    machine: str
    prefill_tok_s: dict[str, float] = field(default_factory=dict)  # "chunkserve <config>" / "transformers"
    prefill_gflop: float = 0.0  # useful work of one prefill
    gemm_peak_gflop_s: dict[str, float] = field(default_factory=dict)  # "chunkserve <config>" -> median peak
    prefill_of_peak: dict[str, float] = field(default_factory=dict)  # "chunkserve <config>" -> median ratio
    decode_tok_s: dict[str, dict[int, float]] = field(default_factory=dict)  # system -> batch -> tok/s
    interference: list[dict[str, Any]] = field(default_factory=list)


def log(message: str) -> None:
    print(f"[engine_speed] {message}", file=sys.stderr, flush=True)


def random_prompts(rng: np.random.Generator, count: int, length: int) -> list[list[int]]:
    return rng.integers(*TOKEN_ID_RANGE, size=(count, length)).tolist()


def median_of_repeats(measure: Callable[[], float], repeats: int) -> float:
    """The median of `repeats` measurements after one untimed warm-up."""
    measure()
    return statistics.median(measure() for _ in range(repeats))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# ----- chunkserve ----------------------------------------------------------------------------


def plan_engine_jobs(chunk_budgets: list[int]) -> list[EngineJob]:
    """Chunked prefill off, then each budget: 512 for prefill and decode, --chunk-budgets for interference."""
    unchunked = {"enable_chunked_prefill": False}
    jobs = [EngineJob("unchunked", unchunked, prefill=True, decode=False, interference=True)]
    for budget in sorted({PREFILL_CHUNK_BUDGET, *chunk_budgets}):
        is_main = budget == PREFILL_CHUNK_BUDGET
        jobs.append(EngineJob(f"chunked {budget}", {"max_num_batched_tokens": budget},
                              prefill=is_main, decode=is_main, interference=budget in chunk_budgets))
    return jobs


def load_engine(model: str | None, engine_args: dict[str, Any], rng: np.random.Generator) -> LLM:
    llm = LLM(model, kv_cache_memory_gb=KV_CACHE_GB, **engine_args)
    llm.generate(random_prompts(rng, 1, WARMUP_PROMPT_LEN), greedy(WARMUP_OUTPUT_LEN), use_tqdm=False)
    return llm


def ours_prefill_s(llm: LLM, prompt_len: int, rng: np.random.Generator) -> float:
    """Summed duration of the steps that processed the prompt of a max_tokens=1 request."""
    first = len(llm.get_step_records())
    llm.generate(random_prompts(rng, 1, prompt_len), greedy(1), use_tqdm=False)
    steps = [r for r in llm.get_step_records()[first:] if r.num_prefill_tokens > 0]
    prefilled = sum(r.num_prefill_tokens for r in steps)
    if prefilled != prompt_len:
        raise RuntimeError(f"step records show {prefilled} prompt tokens for a {prompt_len}-token prompt")
    return sum(r.duration_s for r in steps)


def prefill_gflop(config: ModelConfig, prompt_len: int) -> float:
    """Useful FLOPs of a `prompt_len` prefill: the linear layers for every token, causal attention
    (query i sees i + 1 keys: QK and PV, 2 FLOPs per multiply-add), the LM head for one row."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    linear_per_token = 2 * (config.hidden_size * (q + 2 * kv) + q * config.hidden_size
                            + 3 * config.hidden_size * config.intermediate_size)
    attention = 2 * 2 * q * prompt_len * (prompt_len + 1) / 2
    lm_head = 2 * config.hidden_size * config.vocab_size
    return (config.num_layers * (prompt_len * linear_per_token + attention) + lm_head) / 1e9


def ours_decode_tok_s(llm: LLM, batch: int, steps: int, rng: np.random.Generator) -> float:
    """batch / the median duration of the pure-decode steps that ran the whole batch."""
    first = len(llm.get_step_records())
    llm.generate(random_prompts(rng, batch, DECODE_PROMPT_LEN), greedy(steps), use_tqdm=False)
    durations = [
        r.duration_s for r in llm.get_step_records()[first:]
        if r.forward_mode == ForwardMode.DECODE and r.num_decode_tokens == batch
    ]
    if not durations:
        raise RuntimeError(f"no decode step ran the whole batch of {batch}")
    return batch / statistics.median(durations)


def step_until_done(llm: LLM, finished: dict[str, RequestOutput], max_steps: int | None = None) -> None:
    """Step the engine (at most max_steps times), keeping each request's final output."""
    taken = 0
    while llm.engine.has_unfinished_requests() and (max_steps is None or taken < max_steps):
        finished.update((o.request_id, o) for o in llm.engine.step() if o.finished)
        taken += 1


def ours_interference(llm: LLM, label: str, long_len: int, output_len: int, rng: np.random.Generator) -> dict[str, Any]:
    """Decoders' inter-token gaps while a long prompt arrives mid-decode."""
    decoders = [f"bench-{label}-decode-{i}" for i in range(INTERFERENCE_DECODERS)]
    long_id = f"bench-{label}-long"
    for request_id, prompt in zip(decoders, random_prompts(rng, len(decoders), INTERFERENCE_PROMPT_LEN)):
        llm.engine.add_request(request_id, prompt, greedy(output_len))
    finished: dict[str, RequestOutput] = {}
    step_until_done(llm, finished, max_steps=STEPS_BEFORE_LONG_PROMPT)
    if finished:
        raise RuntimeError("the decoders finished before the long prompt arrived")
    llm.engine.add_request(long_id, random_prompts(rng, 1, long_len)[0], greedy(INTERFERENCE_LONG_OUTPUT_LEN))
    step_until_done(llm, finished)
    gaps_ms = 1000 * np.concatenate([np.diff(finished[r].metrics.token_times) for r in decoders])
    long_metrics = finished[long_id].metrics
    return {
        "config": label,
        "gap_p50_ms": float(np.percentile(gaps_ms, 50)),
        "gap_p99_ms": float(np.percentile(gaps_ms, 99)),
        "gap_max_ms": float(gaps_ms.max()),
        "long_ttft_s": long_metrics.first_token_time - long_metrics.arrival_time,
    }


def run_engine_job(job: EngineJob, args: argparse.Namespace, rng: np.random.Generator, results: Results) -> None:
    log(f"chunkserve, {job.label}: loading")
    llm = load_engine(args.model, job.engine_args, rng)
    if job.prefill:
        log(f"chunkserve, {job.label}: prefill")
        results.prefill_gflop = prefill_gflop(llm.engine.engine_core.model_config, args.prefill_len)
        ours_prefill_s(llm, args.prefill_len, rng)  # warm-up
        runs = [(gemm_peak_gflop_s(3, args.peak_size), ours_prefill_s(llm, args.prefill_len, rng))
                for _ in range(args.repeats)]
        key = f"chunkserve {job.label}"
        results.prefill_tok_s[key] = args.prefill_len / statistics.median(s for _, s in runs)
        results.gemm_peak_gflop_s[key] = statistics.median(peak for peak, _ in runs)
        results.prefill_of_peak[key] = statistics.median(results.prefill_gflop / s / peak for peak, s in runs)
    if job.decode:
        log(f"chunkserve, {job.label}: decode")
        results.decode_tok_s["chunkserve"] = {
            b: ours_decode_tok_s(llm, b, args.decode_steps, rng) for b in args.decode_batches
        }
    if job.interference:
        log(f"chunkserve, {job.label}: interference")
        results.interference.append(ours_interference(llm, job.label, args.prefill_len, args.interference_output_len,
                                                      rng))


# ----- transformers --------------------------------------------------------------------------


class _TokenClock(StoppingCriteria):
    """Never stops generation; records when each new token was produced."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def load_hf_model(model: str | None) -> Any:
    transformers.utils.logging.disable_progress_bar()
    source = resolve_model(model)
    if source.kind == "hf":
        return AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(source.path), gguf_file=os.path.basename(source.path), dtype=torch.float32
    ).eval()


@torch.inference_mode()
def hf_prefill_s(model: Any, prompt_len: int, rng: np.random.Generator) -> float:
    input_ids = torch.tensor(random_prompts(rng, 1, prompt_len))
    start = time.perf_counter()
    model(input_ids=input_ids, logits_to_keep=1)
    return time.perf_counter() - start


@torch.inference_mode()
def hf_decode_tok_s(model: Any, batch: int, steps: int, rng: np.random.Generator) -> float:
    """batch / the median gap between consecutive generated tokens of a greedy generate."""
    input_ids = torch.tensor(random_prompts(rng, batch, DECODE_PROMPT_LEN))
    clock = _TokenClock()
    model.generate(
        input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
        max_new_tokens=steps, min_new_tokens=steps, pad_token_id=model.config.eos_token_id,
        stopping_criteria=StoppingCriteriaList([clock]),
    )
    if len(clock.times) != steps:
        raise RuntimeError(f"transformers generated {len(clock.times)} tokens, expected {steps}")
    return batch / float(np.median(np.diff(clock.times)))


def run_transformers(args: argparse.Namespace, rng: np.random.Generator, results: Results) -> None:
    log("transformers: loading")
    model = load_hf_model(args.model)
    hf_decode_tok_s(model, 1, WARMUP_OUTPUT_LEN, rng)  # warm-up
    log("transformers: prefill")
    seconds = median_of_repeats(lambda: hf_prefill_s(model, args.prefill_len, rng), args.repeats)
    results.prefill_tok_s["transformers"] = args.prefill_len / seconds
    log("transformers: decode")
    results.decode_tok_s["transformers"] = {
        b: hf_decode_tok_s(model, b, args.decode_steps, rng) for b in args.decode_batches
    }


# ----- report --------------------------------------------------------------------------------


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *map(line, rows)])


def speed_row(metric: str, ours: float, reference: float | None) -> list[str]:
    if reference is None:
        return [metric, f"{ours:.1f}", "-", "-"]
    return [metric, f"{ours:.1f}", f"{reference:.1f}", f"{ours / reference:.2f}x"]


def speed_table(results: Results, prefill_len: int) -> str:
    reference = results.prefill_tok_s.get("transformers")
    rows = [
        speed_row(f"prefill tok/s ({prefill_len} tok, {config})", results.prefill_tok_s[f"chunkserve {config}"],
                  reference)
        for config in ("unchunked", f"chunked {PREFILL_CHUNK_BUDGET}")
    ]
    hf_decode = results.decode_tok_s.get("transformers", {})
    rows += [
        speed_row(f"decode tok/s (batch {batch})", tok_s, hf_decode.get(batch))
        for batch, tok_s in results.decode_tok_s["chunkserve"].items()
    ]
    return format_table(["metric", "chunkserve", "transformers", "ratio"], rows)


def prefill_efficiency_table(results: Results, prefill_len: int) -> str:
    unchunked_s = prefill_len / results.prefill_tok_s["chunkserve unchunked"]
    rows = []
    for config in ("unchunked", f"chunked {PREFILL_CHUNK_BUDGET}"):
        key = f"chunkserve {config}"
        seconds = prefill_len / results.prefill_tok_s[key]
        rows.append([config, f"{seconds:.2f}", f"{results.prefill_gflop / seconds:.0f}",
                     f"{results.gemm_peak_gflop_s[key]:.0f}", f"{100 * results.prefill_of_peak[key]:.0f}%",
                     f"{seconds / unchunked_s:.2f}x"])
    headers = ["prefill config", "time s (median)", "GFLOP/s", "GEMM peak GFLOP/s (median)", "of peak (median)",
               "time vs unchunked"]
    return format_table(headers, rows)


def interference_table(results: Results) -> str:
    rows = [
        [r["config"], f"{r['gap_p50_ms']:.1f}", f"{r['gap_p99_ms']:.1f}", f"{r['gap_max_ms']:.1f}",
         f"{r['long_ttft_s']:.3f}"]
        for r in results.interference
    ]
    headers = ["config", "decode gap p50 ms", "p99 ms", "max ms", "long-prompt TTFT s"]
    return format_table(headers, rows)


# ----- main ----------------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of positive integers, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--prefill-len", type=int, default=2048,
                        help="prompt length of the prefill and interference runs")
    parser.add_argument("--decode-batches", type=int_list, default=[1, 16, 64], help="decode batch sizes")
    parser.add_argument("--decode-steps", type=int, default=32, help="output tokens per decode run (at least 2)")
    parser.add_argument("--chunk-budgets", type=int_list, default=[256, 512],
                        help="chunk budgets of the interference runs")
    parser.add_argument("--skip-transformers", action="store_true", help="measure chunkserve only")
    parser.add_argument("--repeats", type=int, default=3, help="timed prefill runs; the median is reported")
    parser.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    add_model_flag(parser)
    add_smoke_flag(parser)
    args = parser.parse_args(argv)
    args.peak_size, args.interference_output_len = 2048, INTERFERENCE_OUTPUT_LEN  # the GEMM peak's matrices
    if args.smoke:
        args.interference_output_len = 2 * STEPS_BEFORE_LONG_PROMPT
        args.prefill_len, args.decode_batches, args.decode_steps = 64, [1, 2], 4
        args.chunk_budgets, args.repeats, args.peak_size = [PREFILL_CHUNK_BUDGET], 1, 256
    if args.decode_steps < 2 or args.repeats < 1 or args.prefill_len < 1:
        parser.error("--decode-steps must be at least 2, --repeats and --prefill-len at least 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    machine = (f"{os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), "
               f"transformers {transformers.__version__}")
    results = Results(machine=machine)
    rng = np.random.default_rng(SEED)
    for job in plan_engine_jobs(args.chunk_budgets):
        run_engine_job(job, args, rng, results)  # the engine is freed when the job returns
    if not args.skip_transformers:
        run_transformers(args, rng, results)
    print(f"machine: {machine}")
    print(f"model: {resolve_model(args.model).name} (float32)\n")
    print(speed_table(results, args.prefill_len) + "\n")
    print(f"prefill efficiency: {results.prefill_gflop:.0f} GFLOP of useful work in a {args.prefill_len}-token prefill")
    print(prefill_efficiency_table(results, args.prefill_len) + "\n")
    print(f"long-prompt interference: {INTERFERENCE_DECODERS} decoders ({INTERFERENCE_PROMPT_LEN}-token prompts, "
          f"{args.interference_output_len} output tokens), a {args.prefill_len}-token prompt arrives after "
          f"{STEPS_BEFORE_LONG_PROMPT} steps")
    print(interference_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **asdict(results)}, f, indent=2)


if __name__ == "__main__":
    main()

"""The engine: one `step()` = schedule -> execute -> update -> outputs."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from chunkserve.config import EngineArgs, SchedulerConfig
from chunkserve.core.request import Request, RequestStatus
from chunkserve.core.scheduler import Scheduler
from chunkserve.core.scheduler_output import (
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
    TokenLogprobs,
    hit_rate,
)
from chunkserve.core.step_predictor import StepShape, StepTimePredictor
from chunkserve.engine.detokenizer import IncrementalDetokenizer
from chunkserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, StepRecord
from chunkserve.engine.tokenizer import load_tokenizer
from chunkserve.errors import InvalidRequestError
from chunkserve.model.config import ModelConfig
from chunkserve.model.loader import ModelSource, load_model, load_model_config, resolve_model
from chunkserve.sampling_params import SamplingParams
from chunkserve.worker.kv_cache import num_blocks_for_memory
from chunkserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MAX_STEP_RECORDS = 100_000


@dataclass
class _Tracked:
    """The engine's side of a request: its text state and timings."""

    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    logprobs: list[TokenLogprobs] | None  # None unless the request asked for logprobs


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.source: ModelSource = resolve_model(args.model)
        self.model_config: ModelConfig = load_model_config(self.source)
        self.tokenizer = load_tokenizer(self.source)
        dtype = _DTYPES[args.dtype]
        num_blocks = args.num_kv_blocks or num_blocks_for_memory(
            self.model_config, dtype, args.kv_cache_memory_gb, args.block_size
        )
        self.max_model_len = self._resolve_max_model_len(num_blocks)
        scheduler_config = SchedulerConfig.from_engine_args(args, self.max_model_len)
        self.scheduler_config = scheduler_config
        self._check_budget(scheduler_config)
        self.eos_token_id, self._extra_stop_ids = self._eos_ids()
        model = load_model(self.source, self.model_config, args.dtype, self.max_model_len)
        self.predictor = StepTimePredictor()
        self.scheduler = Scheduler(scheduler_config, num_blocks, self.predictor)
        self.runner = ModelRunner(model, self.model_config, num_blocks, args.block_size, args.seed,
                                  args.op_backend)
        if scheduler_config.tbt_slo_ms is not None or scheduler_config.ttft_slo_ms is not None:
            self._profile_step_time()
        self._tracked: dict[str, _Tracked] = {}
        self.step_records: deque[StepRecord] = deque(maxlen=MAX_STEP_RECORDS)
        self.last_step_record: StepRecord | None = None  # of the last step(); None if it ran nothing
        self._next_step_id = 0
        logger.info(
            "engine ready: %s (%s), %d KV blocks of %d tokens, max_model_len %d",
            self.source.name, self.model_config.architecture, num_blocks, args.block_size, self.max_model_len,
        )

    # ----- requests ---------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> None:
        """Validate and queue a request. Raises InvalidRequestError; the engine is unchanged then."""
        if request_id in self._tracked:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, token_ids = self._tokenize(prompt)
        params = self._resolve_params(params or SamplingParams(), len(token_ids))
        wall = time.time() if arrival_time is None else arrival_time
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            priority=priority,
            arrival_time=wall,
        )
        self._tracked[request_id] = _Tracked(
            request, text, IncrementalDetokenizer(self.tokenizer, params), RequestMetrics(arrival_time=wall),
            logprobs=None if params.logprobs is None else [],
        )
        self.scheduler.add_request(request)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Abort requests at any point; their blocks return to the pool at once."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        aborted = self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
        return [self._output(request, time.time()) for request in aborted]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. after changing weights); refused (False) while
        any request is unfinished."""
        return self.scheduler.reset_prefix_cache()

    # ----- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        start_wall, start = time.time(), time.perf_counter()
        margin = self.predictor.margin
        scheduled = self.scheduler.schedule()
        runner_output = self.runner.execute(scheduled)
        self.last_step_record = None
        if scheduled.is_empty:
            return []
        updated = self.scheduler.update_from_output(scheduled, runner_output)
        now = time.time()
        for s in scheduled.scheduled:
            metrics = self._tracked[s.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = start_wall
        outputs = [
            self._output(request, now, new_token=True, logprobs=runner_output.logprobs.get(request.request_id))
            for request in updated
        ]
        duration = time.perf_counter() - start
        self.predictor.observe(StepShape.of(scheduled.scheduled), duration)
        errors = self.predictor.error_quantiles()
        self.last_step_record = StepRecord(
            step_id=self._next_step_id,
            start_time=start_wall,
            duration_s=duration,
            predicted_duration_s=scheduled.predicted_duration_s,
            prediction_error_p50=errors[0] if errors else None,
            prediction_error_p90=errors[1] if errors else None,
            slo_margin=margin,
            prefill_wait_guard=scheduled.prefill_wait_guard,
            forward_mode=scheduled.forward_mode,
            num_prefill_tokens=scheduled.num_prefill_tokens,
            num_decode_tokens=scheduled.num_decode_tokens,
            num_requests=len(scheduled.scheduled),
            num_preemptions=len(scheduled.preempted_request_ids),
            kv_cache_usage=self.scheduler.kv.usage,
            prefix_cache_queries=scheduled.prefix_cache_queries,
            prefix_cache_hits=scheduled.prefix_cache_hits,
            prefix_cache_hit_rate=hit_rate(self.scheduler.prefix_cache_hits, self.scheduler.prefix_cache_queries),
        )
        self.step_records.append(self.last_step_record)
        self._next_step_id += 1
        return outputs

    def _output(self, request: Request, now: float, new_token: bool = False,
                logprobs: TokenLogprobs | None = None) -> RequestOutput:
        tracked = self._tracked[request.request_id]
        metrics = tracked.metrics
        new_token_ids, new_logprobs = [], []
        if new_token:
            new_token_ids = request.output_token_ids[-1:]
            if logprobs is not None and tracked.logprobs is not None:
                new_logprobs = [logprobs]
                tracked.logprobs.append(logprobs)
            metrics.token_times.append(now)
            metrics.first_token_time = metrics.first_token_time or now
            matched = tracked.detokenizer.add_tokens(new_token_ids)
            if matched is not None and not request.is_finished:
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
                request.stop_reason = matched
        finished = request.is_finished
        delta = tracked.detokenizer.delta(finished)
        metrics.num_preemptions = request.num_preemptions
        if finished:
            metrics.finished_time = now
            del self._tracked[request.request_id]
        completion = CompletionOutput(
            index=0,
            text=tracked.detokenizer.emitted_text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            text_delta=delta,
            new_token_ids=new_token_ids,
            logprobs=None if tracked.logprobs is None else list(tracked.logprobs),
            new_logprobs=new_logprobs,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=tracked.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=metrics,
            num_cached_tokens=request.num_cached_tokens or 0,
        )

    # ----- validation and set-up ------------------------------------------------------------

    def time_synthetic_step(self, rows: list[tuple[int, int]], seed: int = 0) -> float:
        """Run one step of made-up requests, a (start position, tokens) pair each, and return
        its seconds. For the start-up profile and benchmarks/step_time_curve.py: only while no
        request is unfinished, as its KV lands in blocks 0.. (the prefix cache is dropped)."""
        if self.has_unfinished_requests():
            raise RuntimeError("time_synthetic_step needs an idle engine: its KV overwrites pool blocks")
        self.scheduler.reset_prefix_cache()
        block_size = self.scheduler_config.block_size
        rng = torch.Generator().manual_seed(seed)
        scheduled, new = [], []
        for index, (start, num_tokens) in enumerate(rows):
            length = start + num_tokens
            if not (0 < num_tokens and length <= min(self.max_model_len, self.scheduler.kv.num_blocks * block_size)):
                raise InvalidRequestError(f"synthetic request ({start}, {num_tokens}) does not fit the engine")
            request_id = f"synthetic-{index}"
            prompt = torch.randint(self.model_config.vocab_size, (length,), generator=rng).tolist()
            new.append(NewRequestData(request_id, prompt, SamplingParams(max_tokens=1), None))
            blocks = list(range(-(-length // block_size)))
            scheduled.append(ScheduledRequest(request_id, start, num_tokens, blocks, True, num_tokens == 1))
        begin = time.perf_counter()
        self.runner.execute(SchedulerOutput(scheduled, new))
        seconds = time.perf_counter() - begin
        self.runner.execute(SchedulerOutput([], [], finished_request_ids={r.request_id for r in new}))
        return seconds

    def _profile_step_time(self) -> None:
        """Seed the step-time model with a few synthetic steps (a few seconds at most), so the
        SLOs have predictions from the first real step: chunks of 16 tokens and a quarter, half
        and all of the budget (capped at 512: the model extrapolates linearly), one after a
        long context, decode batches of 1, 8 and 32 rows, and a mix."""
        config = self.scheduler_config
        chunk = min(config.max_num_batched_tokens, 512, self.max_model_len // 2)
        decode_context = min(256, self.max_model_len - 1)
        decodes = [[(decode_context, 1)] * n for n in (1, 8, 32) if n <= config.max_num_seqs]
        steps = [[(0, min(16, chunk))], [(0, max(chunk // 4, 1))], [(0, max(chunk // 2, 1))], [(0, chunk)],
                 [(chunk, chunk)], *decodes, decodes[-1][:8] + [(0, max(chunk // 2, 1))]]
        self.time_synthetic_step(steps[0])  # warm-up
        for index, step in enumerate(steps):
            self.predictor.observe(StepShape.of_rows(step), self.time_synthetic_step(step, seed=index),
                                   count_error=False)
        self.predictor.refit()
        logger.info("step-time model from %d profile steps: %s", len(steps), self.predictor.describe())

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", "prompt")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequestError("prompt must be a string or a list of token ids", "prompt")
        if not prompt:
            raise InvalidRequestError("prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is out of range [0, {vocab})", "prompt")
        return None, list(prompt)

    def _resolve_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise InvalidRequestError(
                f"prompt has {num_prompt_tokens} tokens, but max_model_len is {limit} "
                "(prompt and output must fit, with at least one output token)", "prompt"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - num_prompt_tokens
        if num_prompt_tokens + max_tokens > limit:
            raise InvalidRequestError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
                f"{num_prompt_tokens + max_tokens} exceeds max_model_len ({limit}, which the KV pool can hold)",
                "max_tokens",
            )
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be below the vocabulary size {vocab}", "stop_token_ids")
        extra_stops = [] if params.ignore_eos else [t for t in self._extra_stop_ids if t not in params.stop_token_ids]
        return dataclasses.replace(
            params, max_tokens=max_tokens, stop_token_ids=params.stop_token_ids + extra_stops
        )

    def _resolve_max_model_len(self, num_blocks: int) -> int:
        pool_tokens = num_blocks * self.args.block_size
        model_limit = self.model_config.max_position_embeddings
        if self.model_config.sliding_window:
            model_limit = min(model_limit, self.model_config.sliding_window)
        requested = self.args.max_model_len
        if requested is None:
            if pool_tokens < model_limit:
                logger.warning("max_model_len capped at %d tokens: all the KV pool holds", pool_tokens)
            return min(model_limit, pool_tokens)
        if requested > model_limit:
            raise InvalidRequestError(f"max_model_len {requested} exceeds the model's limit of {model_limit} tokens")
        if requested > pool_tokens:
            raise InvalidRequestError(
                f"max_model_len {requested} exceeds what the KV pool holds ({num_blocks} blocks x "
                f"{self.args.block_size} = {pool_tokens} tokens): raise kv_cache_memory_gb or num_kv_blocks"
            )
        return requested

    def _check_budget(self, config: SchedulerConfig) -> None:
        if config.max_num_batched_tokens < config.max_num_seqs:
            raise InvalidRequestError(
                f"max_num_batched_tokens ({config.max_num_batched_tokens}) must be at least max_num_seqs "
                f"({config.max_num_seqs}), so every running decode fits in a step"
            )
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < config.max_model_len:
            raise InvalidRequestError(
                f"with chunked prefill off a whole prompt must fit one step: max_num_batched_tokens "
                f"({config.max_num_batched_tokens}) must be at least max_model_len ({config.max_model_len})"
            )

    def _eos_ids(self) -> tuple[int | None, list[int]]:
        """The tokenizer's EOS plus any other EOS ids of the model's generation config
        (Llama 3 instruct ends turns with a second one)."""
        eos = self.tokenizer.eos_token_id
        extra: list[int] = []
        path = os.path.join(self.source.path, "generation_config.json")
        if self.source.kind == "hf" and os.path.isfile(path):
            with open(path) as f:
                configured: Any = json.load(f).get("eos_token_id")
            ids = configured if isinstance(configured, list) else [configured] if configured is not None else []
            eos = eos if eos is not None else (ids[0] if ids else None)
            extra = [i for i in ids if i != eos]
        return eos, extra

"""The frontend's side of a running request: the engine core's new token ids become text
(incremental detokenization), stop strings are found, and each step's `RequestOutput` is
built with the request's metrics. A stop string ends the request here; the caller then aborts
it in the core (`ProcessedOutputs.requests_to_abort`), as vLLM V1 does."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from chunkserve.core.sched.output import EngineCoreOutput, TokenLogprobs
from chunkserve.engine.detokenizer import IncrementalDetokenizer
from chunkserve.engine.messages import EngineCoreRequest
from chunkserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from chunkserve.errors import InvalidRequestError


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer  # holds the output token ids too
    metrics: RequestMetrics
    logprobs: list[TokenLogprobs] | None  # None unless the request asked for logprobs


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    requests_to_abort: list[str] = field(default_factory=list)  # finished here by a stop string


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, RequestState] = {}

    def add_request(self, request: EngineCoreRequest, prompt: str | None) -> None:
        if request.request_id in self._states:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        params = request.sampling_params
        self._states[request.request_id] = RequestState(
            request.request_id, prompt, request.prompt_token_ids, IncrementalDetokenizer(self.tokenizer, params),
            RequestMetrics(arrival_time=request.arrival_time), logprobs=None if params.logprobs is None else [],
        )

    def has_request(self, request_id: str) -> bool:
        return request_id in self._states

    def remove_request(self, request_id: str) -> None:
        """Forget a request the core refused (or that will never report back)."""
        self._states.pop(request_id, None)

    @property
    def num_unfinished(self) -> int:
        return len(self._states)

    def process_outputs(self, outputs: list[EngineCoreOutput], timestamp: float) -> ProcessedOutputs:
        """`outputs` of one step (or of aborts), which ended at wall-clock `timestamp`."""
        processed = ProcessedOutputs()
        for output in outputs:
            state = self._states.get(output.request_id)
            if state is None:  # finished here already (a stop string), or never ours
                continue
            processed.request_outputs.append(self._process(state, output, timestamp, processed))
        return processed

    def _process(self, state: RequestState, output: EngineCoreOutput, timestamp: float,
                 processed: ProcessedOutputs) -> RequestOutput:
        metrics = state.metrics
        detokenizer = state.detokenizer
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = output.first_scheduled_time
        metrics.num_preemptions = output.num_preemptions
        finish_reason, stop_reason = output.finish_reason, output.stop_reason
        new_token_ids: list[int] = []
        new_logprobs: list[TokenLogprobs] = []
        if output.new_token_ids:
            before = len(detokenizer.token_ids)
            matched = detokenizer.add_tokens(output.new_token_ids)
            new_token_ids = detokenizer.token_ids[before:]
            count = len(new_token_ids)
            if output.new_logprobs is not None and state.logprobs is not None:
                new_logprobs = output.new_logprobs[:count]
                state.logprobs.extend(new_logprobs)
            metrics.token_times.extend([timestamp] * count)
            metrics.first_token_time = metrics.first_token_time or timestamp
            cut = count < len(output.new_token_ids)  # the stop string came before the core's own finish
            if matched is not None and (finish_reason is None or cut):
                if finish_reason is None:
                    processed.requests_to_abort.append(state.request_id)
                finish_reason, stop_reason = "stop", matched
        finished = finish_reason is not None
        delta = detokenizer.delta(finished)
        if finished:
            metrics.finished_time = timestamp
            del self._states[state.request_id]
        completion = CompletionOutput(
            index=0,
            text=detokenizer.emitted_text,
            token_ids=list(detokenizer.token_ids),
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            text_delta=delta,
            new_token_ids=new_token_ids,
            logprobs=None if state.logprobs is None else list(state.logprobs),
            new_logprobs=new_logprobs,
        )
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=metrics,
            num_cached_tokens=output.num_cached_tokens,
        )

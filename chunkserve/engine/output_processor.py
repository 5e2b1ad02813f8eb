"""The frontend's side of a running request: the engine core's new token ids become text
(incremental detokenization), stop strings are found, and each step's `RequestOutput` is
built with the request's metrics. A stop string ends the request here; the caller then aborts
it in the core (`ProcessedOutputs.requests_to_abort`), as vLLM V1 does.

States are keyed by the core's request id, which a frontend may make unique per request
(`AsyncLLM` does): the core may still report a request the frontend finished (it runs ahead
of a stop string's abort), and that late output must never reach a newer request that reuses
the caller's id. Outputs carry the caller's id.

What an output carries follows the request's `output_kind`: everything so far (CUMULATIVE),
only what is new (DELTA: a stream's events, so an output's size does not grow with the
request's history), or only what is new until the last output, which carries everything
(FINAL_ONLY: the caller keeps only the last)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from chunkserve.core.messages import EngineCoreOutput, TokenLogprobs
from chunkserve.engine.detokenizer import IncrementalDetokenizer
from chunkserve.engine.messages import EngineCoreRequest
from chunkserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from chunkserve.errors import InvalidRequestError, KVTransferError
from chunkserve.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)


@dataclass
class RequestState:
    request_id: str  # the caller's
    prompt: str | None
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer  # holds the output token ids too
    metrics: RequestMetrics
    output_kind: RequestOutputKind
    logprobs: list[TokenLogprobs] | None  # all so far (None unless asked for, or when only deltas are sent)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # prompt_logprobs, once they came with the first token


@dataclass
class ProcessedOutputs:
    outputs: dict[str, RequestOutput] = field(default_factory=dict)  # by core id, in the step's order
    requests_to_abort: list[str] = field(default_factory=list)  # core ids finished here (stop strings, failures)
    failed: dict[str, Exception] = field(default_factory=dict)  # core id -> why its output could not be made

    @property
    def request_outputs(self) -> list[RequestOutput]:
        return list(self.outputs.values())


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, RequestState] = {}

    def add_request(self, request: EngineCoreRequest, prompt: str | None, external_id: str | None = None) -> None:
        """Track `request` (keyed by its core id); its outputs carry `external_id` (default: the same)."""
        if request.request_id in self._states:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        params = request.sampling_params
        self._states[request.request_id] = RequestState(
            external_id or request.request_id, prompt, request.prompt_token_ids,
            IncrementalDetokenizer(self.tokenizer, params),
            RequestMetrics(arrival_time=request.arrival_time, max_tokens=params.max_tokens),
            params.output_kind,
            logprobs=None if params.logprobs is None or params.output_kind == RequestOutputKind.DELTA else [],
        )

    def add_imported(self, request: EngineCoreRequest, output_token_ids: list[int], exported: dict | None,
                     external_id: str) -> None:
        """Track an imported request, continuing from the frontend state it was exported with
        (`export_state`); without one, its output so far counts as already handed out. Raises
        InvalidRequestError (tracking nothing) if that state cannot be restored."""
        self.add_request(request, None if exported is None else exported["prompt"], external_id)
        state = self._states[request.request_id]
        try:
            if exported is None:
                state.detokenizer.add_tokens(output_token_ids)
                state.detokenizer.delta(finished=False)
                return
            state.detokenizer.restore(output_token_ids, exported["detokenizer"])
            state.metrics = RequestMetrics(**exported["metrics"])
            if state.logprobs is not None and exported["logprobs"] is not None:
                state.logprobs = [TokenLogprobs(token, logprob, [tuple(t) for t in top], rank)
                                  for token, logprob, top, rank in exported["logprobs"]]
        except (KeyError, TypeError, ValueError) as error:
            del self._states[request.request_id]
            raise InvalidRequestError(f"the snapshot's frontend state cannot be restored: {error!r}") from None

    def export_state(self, request_id: str) -> dict:
        """The request's frontend state for a snapshot (JSON-ready): its caller's id, prompt
        text, detokenizer and stop-string state, metrics and logprobs so far."""
        state = self._states[request_id]
        logprobs = None if state.logprobs is None else [
            [r.token_id, r.logprob, [list(t) for t in r.top], r.rank] for r in state.logprobs]
        return {"request_id": state.request_id, "prompt": state.prompt,
                "detokenizer": state.detokenizer.state(), "metrics": dataclasses.asdict(state.metrics),
                "logprobs": logprobs}

    def pause_for_export(self, request_id: str, timestamp: float) -> RequestOutput:
        """The request left for another engine: forget it and return its last output here,
        finished ("abort") with no new text (what it held back travels with the snapshot)."""
        state = self._states.pop(request_id)
        detokenizer = state.detokenizer
        state.metrics.finished_time = timestamp
        delta = state.output_kind == RequestOutputKind.DELTA
        completion = CompletionOutput(
            index=0, text="" if delta else detokenizer.emitted_text,
            token_ids=[] if delta else list(detokenizer.token_ids), finish_reason="abort",
            logprobs=None if state.logprobs is None else list(state.logprobs))
        return RequestOutput(state.request_id, state.prompt, state.prompt_token_ids, [completion], True, state.metrics)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._states

    def remove_request(self, request_id: str) -> None:
        """Forget a request the core refused (or that will never report back)."""
        self._states.pop(request_id, None)

    def process_outputs(self, outputs: list[EngineCoreOutput], timestamp: float) -> ProcessedOutputs:
        """`outputs` of one step (or of aborts), which ended at wall-clock `timestamp`."""
        processed = ProcessedOutputs()
        for output in outputs:
            state = self._states.get(output.request_id)
            if state is None:  # finished here already (a stop string), or never ours
                continue
            if output.error is not None and output.kv_transfer_failed and state.output_kind == RequestOutputKind.DELTA:
                # a stream that already began ends the way an abort ends it (its reason is in the server's log)
                output = output._replace(error=None)
            if output.error is not None:  # the engine failed it
                del self._states[output.request_id]
                kind = KVTransferError if output.kv_transfer_failed else RuntimeError
                processed.failed[output.request_id] = kind(output.error)
                continue
            try:
                processed.outputs[output.request_id] = self._process(output.request_id, state, output, timestamp,
                                                                     processed)
            except Exception as error:  # e.g. the tokenizer failing on one request: fail that one alone
                logger.exception("could not process the output of request %s", state.request_id)
                del self._states[output.request_id]
                if output.finish_reason is None:
                    processed.requests_to_abort.append(output.request_id)
                processed.failed[output.request_id] = RuntimeError(
                    f"processing its output failed ({error!r}); the request was aborted")
        return processed

    def _process(self, core_id: str, state: RequestState, output: EngineCoreOutput, timestamp: float,
                 processed: ProcessedOutputs) -> RequestOutput:
        metrics = state.metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = output.first_scheduled_time
        metrics.num_preemptions = output.num_preemptions
        if output.new_prompt_logprobs is not None:
            state.prompt_logprobs = output.new_prompt_logprobs
        finish_reason, stop_reason = output.finish_reason, output.stop_reason
        if output.new_token_ids:
            new_token_ids, new_logprobs, matched = _add_tokens(state, output, timestamp)
            cut = len(new_token_ids) < len(output.new_token_ids)  # the stop string came before the core's own finish
            if matched is not None and (finish_reason is None or cut):
                if finish_reason is None:
                    processed.requests_to_abort.append(core_id)
                finish_reason, stop_reason = "stop", matched
        else:
            new_token_ids, new_logprobs = [], []
        finished = finish_reason is not None
        delta = state.detokenizer.delta(finished)
        if finished:
            metrics.finished_time = timestamp
            del self._states[core_id]
        return _request_output(state, output, finish_reason, stop_reason, delta, new_token_ids, new_logprobs)


def _add_tokens(state: RequestState, output: EngineCoreOutput,
                timestamp: float) -> tuple[list[int], list[TokenLogprobs], str | None]:
    """Detokenizes the step's new tokens -> those kept (a stop string cuts the rest), their
    logprobs, and the stop string matched (None if none)."""
    detokenizer, metrics = state.detokenizer, state.metrics
    before = len(detokenizer.token_ids)
    hides_stop_token = output.finish_reason == "stop" and not detokenizer.include_stop  # the core's: a stop token
    matched = detokenizer.add_tokens(output.new_token_ids[:-1] if hides_stop_token else output.new_token_ids)
    if hides_stop_token and matched is None:
        detokenizer.add_stop_token(output.new_token_ids[-1])
    new_token_ids = detokenizer.token_ids[before:]
    count = len(new_token_ids)
    new_logprobs: list[TokenLogprobs] = []
    if output.new_logprobs is not None:
        new_logprobs = output.new_logprobs[:count]
        if state.logprobs is not None:
            state.logprobs.extend(new_logprobs)
    metrics.token_times.extend([timestamp] * count)
    metrics.first_token_time = metrics.first_token_time or timestamp
    return new_token_ids, new_logprobs, matched


def _request_output(state: RequestState, output: EngineCoreOutput, finish_reason: str | None,
                    stop_reason: int | str | None, delta: str, new_token_ids: list[int],
                    new_logprobs: list[TokenLogprobs]) -> RequestOutput:
    """The step's RequestOutput: the step's delta or the whole output so far, by the request's output_kind."""
    detokenizer = state.detokenizer
    finished = finish_reason is not None
    kind = state.output_kind
    # FINAL_ONLY outputs before the last are made (step observers count tokens from them) but
    # kept small; a caller that asked for FINAL_ONLY is handed only the last
    if kind == RequestOutputKind.DELTA or (kind == RequestOutputKind.FINAL_ONLY and not finished):
        wants_logprobs = output.new_logprobs is not None
        text, token_ids, logprobs = delta, new_token_ids, new_logprobs if wants_logprobs else None
        prompt_logprobs = output.new_prompt_logprobs
    else:
        text, token_ids = detokenizer.emitted_text, list(detokenizer.token_ids)
        logprobs = None if state.logprobs is None else list(state.logprobs)
        prompt_logprobs = state.prompt_logprobs
    completion = CompletionOutput(
        index=0,
        text=text,
        token_ids=token_ids,
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        text_delta=delta,
        new_token_ids=new_token_ids,
        logprobs=logprobs,
        new_logprobs=new_logprobs,
    )
    return RequestOutput(
        request_id=state.request_id,
        prompt=state.prompt,
        prompt_token_ids=state.prompt_token_ids,
        outputs=[completion],
        finished=finished,
        metrics=state.metrics,
        num_cached_tokens=output.num_cached_tokens,
        prompt_logprobs=prompt_logprobs,
    )

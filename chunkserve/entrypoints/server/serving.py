"""The request handlers behind the routes: OpenAI completions and chat completions, and
SGLang's /generate. Each turns a validated body into engine requests and the engine's
outputs into response bodies or server-sent events (one event per sampled token)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from chunkserve.core.disagg.protocol import TransferParams
from chunkserve.core.kv.snapshot import RequestSnapshot
from chunkserve.core.messages import TokenLogprobs
from chunkserve.engine.async_llm import AsyncLLM, RequestStream
from chunkserve.engine.beam_search import beam_search_async
from chunkserve.engine.beam_search import completion as beam_completion
from chunkserve.engine.outputs import RequestMetrics, RequestOutput, logprob_dict
from chunkserve.entrypoints.server.metrics import EngineMetrics
from chunkserve.entrypoints.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GENERATE_NAMES,
    ExportBody,
    GenerateRequest,
    GenerateSamplingParams,
    TokenIds,
    TokenizeRequest,
    error_body,
    rename_error,
)
from chunkserve.entrypoints.server.tool_calls import CallStream, ChatToolCalls, Delta
from chunkserve.entrypoints.server.tool_parsers import ToolParser
from chunkserve.errors import EngineDeadError, InvalidRequestError
from chunkserve.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)
Event = dict[str, Any]


def sse(payload: Event | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def usage(outputs: list[RequestOutput], completion_tokens: int | None = None, n: int = 1) -> dict[str, Any]:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens` counts the prompt tokens
    read from the prefix cache. `outputs`: n samples of each prompt in turn (a prompt counts
    once, by its first sample's). `completion_tokens`: counted by a stream (its outputs carry
    only what was new), else the outputs' own."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs[::n])
    if completion_tokens is None:
        completion_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens for o in outputs[::n])
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


class Serving:
    def __init__(self, engine: AsyncLLM, model_names: list[str], max_prompts_per_request: int,
                 response_role: str = "assistant", log_requests: bool = False, max_log_len: int | None = None,
                 return_tokens_as_token_ids: bool = False, trust_request_chat_template: bool = False,
                 metrics: EngineMetrics | None = None, tool_parser: type[ToolParser] | None = None,
                 exclude_tools_when_tool_choice_none: bool = False) -> None:
        """`model_names`: what a request may name (--served-model-name); responses name the first.
        `trust_request_chat_template`: whether a request may bring its own chat template.
        `metrics`: told which engine requests are the samples of one prompt. `tool_parser`: how
        tool_choice "auto" reads calls from the text (--tool-call-parser), None without
        --enable-auto-tool-choice. `exclude_tools_when_tool_choice_none`: vLLM's flag of that name."""
        self.engine = engine
        self.metrics = metrics
        self.model_names = model_names
        self.model_name = model_names[0]
        self.max_prompts_per_request = max_prompts_per_request
        self.response_role = response_role
        self.log_requests = log_requests
        self.max_log_len = max_log_len
        self.return_tokens_as_token_ids = return_tokens_as_token_ids  # the server's default (a request may say)
        self.trust_request_chat_template = trust_request_chat_template
        self.tool_parser = tool_parser
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none
        self.tokenizer = engine.tokenizer
        self._token_text = functools.lru_cache(maxsize=1 << 16)(lambda t: self.tokenizer.decode([t]))

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            served = ", ".join(repr(name) for name in self.model_names)
            raise InvalidRequestError(f"model {model!r} does not exist; this server serves {served}", "model")

    async def health_generate(self, timeout_s: float) -> dict[str, Any]:
        """One greedy token through the whole engine; EngineDeadError (503) if it does not come in time."""
        params = SamplingParams(max_tokens=1, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY)
        (stream,) = await self._add_all(f"health-{uuid.uuid4().hex}", [[0]], params, 0, None)
        try:
            await asyncio.wait_for(_collect([stream]), timeout_s)
        except asyncio.TimeoutError:
            stream.abort()
            raise EngineDeadError(f"the engine did not generate a token within {timeout_s:g} s") from None
        return {}

    # ----- /tokenize, /detokenize (vLLM's) ----------------------------------------------------

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        body.check_fields()
        if body.messages is not None:
            if body.prompt is not None:
                raise InvalidRequestError("give prompt or messages, not both", "prompt")
            self._check_template_trust(body)
            tokens = await self.engine.apply_chat_template(
                [m.as_template_message() for m in body.messages],
                **body.template_options(bool(body.add_special_tokens)))
        elif body.prompt is not None:
            tokens = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        else:
            raise InvalidRequestError("give prompt (text) or messages (a conversation)", "prompt")
        strs = self.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": self.engine.info.max_model_len, "tokens": list(tokens),
                "token_strs": strs}

    def _check_template_trust(self, body: ChatCompletionRequest | TokenizeRequest) -> None:
        """A request's own chat template runs only on a server that trusts it (vLLM's flag and
        message): a Jinja template is code, and rendering it can take unbounded time."""
        if body.has_request_template and not self.trust_request_chat_template:
            raise InvalidRequestError("Chat template is passed with request, but --trust-request-chat-template is "
                                      "not set. Refused request with untrusted chat template.", "chat_template")

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        vocab = self.engine.info.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is out of range [0, {vocab})", "tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    # ----- /v1/completions -------------------------------------------------------------------

    def check_request(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """What every OpenAI request must pass before any work: its model, its fields, its priority."""
        self.check_model(body.model)
        body.check_fields()
        if body.priority != 0 and self.engine.scheduling_policy != "priority":
            raise InvalidRequestError("priority is only supported with --scheduling-policy priority (as in vLLM)",
                                      "priority")

    async def completions(self, body: CompletionRequest, raw: Request) -> JSONResponse | StreamingResponse:
        self.check_request(body)
        prompts = body.prompts()
        if len(prompts) * body.n > self.max_prompts_per_request:
            raise InvalidRequestError(f"prompt has {len(prompts)} prompts x n = {body.n} samples, over the limit of "
                                      f"{self.max_prompts_per_request} (--max-prompts-per-request)", "prompt")
        params = body.sampling_params(body.completion_max_tokens(), body.logprobs, self.engine.generation_defaults)
        echo_logprobs = body.echo and body.logprobs is not None  # the echoed prompt's tokens get logprobs too
        if echo_logprobs:
            params = dataclasses.replace(params, prompt_logprobs=max(body.logprobs, params.prompt_logprobs or 0))
        as_ids = self._tokens_as_ids(body)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = [] if body.use_beam_search else await self._add_all(
            request_id, prompts, params, body.priority, body.cache_salt, kv_transfer_params=body.transfer_params(),
            n=body.n, add_special_tokens=body.add_special_tokens, field_names=body.structured_outputs_names())
        head = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        echoes = [self._prompt_text(p) if body.echo else "" for p in prompts for _ in range(body.n)]

        def choice(index: int, output: RequestOutput, text: str, logprobs: list[TokenLogprobs] | None) -> Event:
            """`output.prompt_logprobs` is set in a request's first (or only) output."""
            completion, prompt_records = output.outputs[0], output.prompt_logprobs
            records = None if logprobs is None else [(r.token_id, r) for r in logprobs]
            if body.echo_only and records is not None:
                records = []  # the one sampled token is not part of the answer
            if records is not None and echo_logprobs and prompt_records is not None:
                records = [*zip(output.prompt_token_ids, prompt_records), *records]
            event = {
                "index": index, "text": text,
                "logprobs": None if records is None else self._completion_logprobs(records, as_ids),
                "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
            }
            if body.prompt_logprobs is not None and prompt_records is not None:
                event["prompt_logprobs"] = self._vllm_prompt_logprobs(prompt_records)
            return event

        if not body.stream:
            outputs = await _unless_disconnected(raw, self._beam_search(
                request_id, prompts, body, params, add_special_tokens=body.add_special_tokens)
                if body.use_beam_search else _collect(streams))
            choices = [choice(i, o, echoes[i] + ("" if body.echo_only else o.outputs[0].text), o.outputs[0].logprobs)
                       for i, o in enumerate(outputs)]
            return JSONResponse({**head, "choices": choices, "usage": usage(outputs, n=body.n)})

        async def events() -> AsyncIterator[str]:
            finals: dict[int, RequestOutput] = {}
            generated = 0
            async for index, output in _merge(streams):
                completion = output.outputs[0]
                generated += len(completion.new_token_ids)
                text = echoes[index] + ("" if body.echo_only else completion.text_delta)
                echoes[index] = ""
                logprobs = completion.new_logprobs if params.logprobs is not None else None
                yield sse({**head, "choices": [choice(index, output, text, logprobs)], "usage": None})
                if output.finished:
                    finals[index] = output
            if body.include_usage:
                yield sse({**head, "choices": [], "usage": usage([finals[i] for i in sorted(finals)], generated,
                                                                 body.n)})
            yield sse("[DONE]")

        return _event_stream(events(), streams)

    # ----- /v1/chat/completions -------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> JSONResponse | StreamingResponse:
        self.check_request(body)
        self._check_template_trust(body)
        calls = ChatToolCalls(body, self.tool_parser)
        messages = [m.as_template_message() for m in body.messages]
        params = calls.sampling_params(body.chat_sampling_params(self.engine.generation_defaults))
        options = body.template_options(body.add_special_tokens)
        if calls.choice == "none" and self.exclude_tools_when_tool_choice_none:
            options["tools"] = None
        prompt = await self.engine.apply_chat_template(messages, **options)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        given = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        streams = [] if body.use_beam_search else await self._add_all(
            request_id, [prompt], params, body.priority, body.cache_salt,
            {"max_tokens": given, "logprobs": "top_logprobs", **body.structured_outputs_names(),
             **calls.field_names()}, body.transfer_params(), body.n)
        created = int(time.time())
        as_ids = self._tokens_as_ids(body)

        def logprobs_of(records: list[TokenLogprobs] | None) -> Event | None:
            return None if records is None else {"content": [self._chat_logprob(r, as_ids) for r in records]}

        if not body.stream:
            outputs = await _unless_disconnected(raw, self._beam_search(request_id, [prompt], body, params)
                                                 if body.use_beam_search else _collect(streams))
            answers = [(o.outputs[0], *calls.message(o.outputs[0].text, o.outputs[0].finish_reason)) for o in outputs]
            return JSONResponse({
                "id": request_id, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": [{
                    "index": index, "message": {"role": self.response_role, **message},
                    "logprobs": logprobs_of(completion.logprobs),
                    "finish_reason": finish_reason, "stop_reason": completion.stop_reason,
                } for index, (completion, message, finish_reason) in enumerate(answers)],
                "usage": usage(outputs, n=body.n),
                **({"prompt_logprobs": self._vllm_prompt_logprobs(outputs[0].prompt_logprobs)}
                   if body.prompt_logprobs is not None and outputs[0].prompt_logprobs is not None else {}),
            })

        head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": self.model_name}

        async def events() -> AsyncIterator[str]:
            finals: dict[int, RequestOutput] = {}
            generated = 0
            readers = [calls.stream() for _ in range(body.n)] if calls.active else None
            role_sent = False
            async for index, output in _merge(streams):
                if not role_sent:  # with the first output, as vLLM: a client timing its first chunk sees the TTFT
                    role_sent = True
                    for choice_index in range(body.n):
                        yield sse({**head, "choices": [
                            {"index": choice_index, "delta": {"role": self.response_role, "content": ""},
                             "logprobs": None, "finish_reason": None}
                        ]})
                completion = output.outputs[0]
                generated += len(completion.new_token_ids)
                logprobs = logprobs_of(completion.new_logprobs if params.logprobs is not None else None)
                choices = [{
                    "index": index, "delta": {"content": completion.text_delta}, "logprobs": logprobs,
                    "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
                }] if readers is None else _tool_call_choices(readers[index], index, completion, output.finished,
                                                              logprobs)
                for choice in choices:
                    yield sse({**head, "choices": [choice]})
                if output.finished:
                    finals[index] = output
            if body.include_usage and finals:
                yield sse({**head, "choices": [], "usage": usage([finals[i] for i in sorted(finals)], generated,
                                                                 body.n)})
            yield sse("[DONE]")

        return _event_stream(events(), streams)

    # ----- /generate (SGLang) -----------------------------------------------------------------

    async def generate(self, body: GenerateRequest, raw: Request) -> JSONResponse | StreamingResponse:
        """One prompt is answered with one result object; a batch (text or input_ids as a list)
        or n > 1 with a list of results, n per prompt, prompt by prompt (SGLang's order)."""
        body.check_fields()
        prompts = body.prompts()
        count = len(prompts)
        sampling = body.per_prompt("sampling_params", count, GenerateSamplingParams())
        for given in sampling:
            given.check_fields()
        n = sampling[0].n
        if any(given.n != n for given in sampling):
            raise InvalidRequestError("every prompt's sampling_params must ask for the same n (as in SGLang)",
                                      "sampling_params")
        field = "text" if body.text is not None else "input_ids"
        if count * n > self.max_prompts_per_request:
            raise InvalidRequestError(f"{field} has {count} prompts x n = {n} samples, over the limit of "
                                      f"{self.max_prompts_per_request} (--max-prompts-per-request)", field)
        transfer = body.transfer_params()
        if transfer is not None and count * n > 1:
            raise InvalidRequestError("a disaggregated request takes one prompt and n = 1 (one bootstrap_room each)",
                                      field)
        asked = _logprobs_asked(body, count)
        await self._check_logprob_start(prompts, asked)
        request_ids = body.request_ids(count, f"gen-{uuid.uuid4().hex}")
        streams: list[RequestStream] = []
        try:
            for prompt, given, request_id, logprobs in zip(prompts, sampling, request_ids, asked):
                top = None if logprobs is None else logprobs.top
                params = given.to_sampling_params(body.stream, self.engine.generation_defaults, top,
                                                  None if logprobs is None or logprobs.start < 0 else top)
                streams += await self._add_all(request_id, [prompt], params, 0, body.cache_salt,
                                               field_names=given.structured_outputs_names(),
                                               kv_transfer_params=transfer, n=n)
        except BaseException as error:
            for stream in streams:
                stream.abort()
            name = GENERATE_NAMES.get(error.param) if isinstance(error, InvalidRequestError) else None
            if name is None:
                raise
            # the first mention only: the message starts with the field (a flag like --max-logprobs may follow)
            raise InvalidRequestError(str(error).replace(error.param, name, 1), name) from None
        if not body.is_batch and n == 1:
            return await self._generate_response(streams[0].request_id, streams[0], body.stream, raw,
                                                 logprobs=asked[0])
        samples = [_GenerateSample(stream.request_id, asked[index // n]) for index, stream in enumerate(streams)]
        return await self._generate_answer(streams, samples, body.stream, raw, batch=True)

    async def _check_logprob_start(self, prompts: list[str | TokenIds], asked: list[GenerateLogprobs | None]) -> None:
        """SGLang's 400 for a logprob_start_len at or past the prompt's end, before any work (a
        text prompt is tokenized for it here, as the engine will)."""
        for prompt, logprobs in zip(prompts, asked):
            if logprobs is None or logprobs.start <= 0:
                continue
            length = len(prompt) if not isinstance(prompt, str) else len(
                await asyncio.get_running_loop().run_in_executor(None, self.tokenizer.encode, prompt))
            if logprobs.start >= length:
                raise InvalidRequestError(f"logprob_start_len ({logprobs.start}) must be below the number of prompt "
                                          f"tokens ({length})", "logprob_start_len")

    async def _generate_response(self, request_id: str, stream: RequestStream, streamed: bool, raw: Request,
                                 text_before: str = "", token_ids_before: tuple[int, ...] = (),
                                 logprobs: GenerateLogprobs | None = None) -> JSONResponse | StreamingResponse:
        """/generate's answer to one prompt (SGLang's shape: one object, or a stream of them).
        `text_before`/`token_ids_before`: the output an imported request had when it was
        exported, which a stream's events include. `logprobs`: what meta_info reports of them."""
        sample = _GenerateSample(request_id, logprobs, text_before, list(token_ids_before))
        return await self._generate_answer([stream], [sample], streamed, raw, batch=False)

    async def _generate_answer(self, streams: list[RequestStream], samples: list[_GenerateSample], streamed: bool,
                               raw: Request, batch: bool) -> JSONResponse | StreamingResponse:
        """Stream i's result is samples[i]'s: a batch is answered with the list of them, one
        prompt with the object. SGLang streams the whole text so far in every event; a batch's
        events each carry one result and its place in the list (`index`)."""
        if not streamed:
            outputs = await _unless_disconnected(raw, _collect(streams))
            results = [self._generate_result(sample.final(output), output) for sample, output in zip(samples, outputs)]
            return JSONResponse(results if batch else results[0])

        async def events() -> AsyncIterator[str]:
            async for index, output in _merge(streams):
                result = self._generate_result(samples[index].add(output), output)
                yield sse({**result, "index": index} if batch else result)
            yield sse("[DONE]")

        return _event_stream(events(), streams)

    def _generate_result(self, sample: _GenerateSample, output: RequestOutput) -> Event:
        """One result object: the text and output ids so far, and meta_info (SGLang's keys)."""
        metrics = output.metrics
        end = metrics.finished_time if output.finished else time.time()
        count = len(sample.token_ids)
        meta = {
            "id": sample.request_id, "prompt_tokens": len(output.prompt_token_ids), "completion_tokens": count,
            "cached_tokens": output.num_cached_tokens,
            "finish_reason": _sglang_finish_reason(output.outputs[0], count) if output.finished else None,
            "e2e_latency": end - metrics.arrival_time,
        }
        if sample.logprobs is not None:
            meta.update(self._sglang_logprobs(sample, output.prompt_token_ids))
        return {"text": sample.text, "output_ids": list(sample.token_ids), "meta_info": meta}

    def _sglang_logprobs(self, sample: _GenerateSample, prompt_token_ids: list[int]) -> Event:
        """meta_info's logprobs in SGLang's shape: per position [logprob, token id, text or None]
        (the text with return_text_in_logprobs), and with top_logprobs_num the top ones. The
        prompt's run from logprob_start_len (-1: its last token only), the first with logprob
        None, as SGLang pads it. Built once per token, however many events show them."""
        asked = sample.logprobs
        as_text = self._token_text if asked.with_text else lambda _: None

        def tops(record: TokenLogprobs) -> list[list[Any]]:
            return [[logprob, token_id, as_text(token_id)] for token_id, logprob in record.top]

        if sample.shown_input is None:
            start = asked.start if asked.start >= 0 else len(prompt_token_ids) - 1
            records = [] if sample.prompt_records is None else sample.prompt_records[start + 1:]
            shown = {"input_token_logprobs": [[None, prompt_token_ids[start], as_text(prompt_token_ids[start])]] + [
                [r.logprob, r.token_id, as_text(r.token_id)] for r in records]}
            if asked.top > 0:
                shown["input_top_logprobs"] = [None] + [tops(r) for r in records]
            if asked.start < 0 or sample.prompt_records is not None:  # else they may still come
                sample.shown_input = shown
        else:
            shown = sample.shown_input
        new = sample.records[len(sample.shown_output):]
        sample.shown_output += [[r.logprob, r.token_id, as_text(r.token_id)] for r in new]
        meta = {**shown, "output_token_logprobs": sample.shown_output}
        if asked.top > 0:
            sample.shown_top += [tops(r) for r in new]
            meta["output_top_logprobs"] = sample.shown_top
        return meta

    # ----- snapshots: a request moved between servers ---------------------------------------

    async def export_request(self, request_id: str, mode: str, body: bytes) -> Response:
        """The request's snapshot (RequestSnapshot's bytes) as of the last step. The body may
        name blocks the destination caches (`{"skip_block_hashes": [hex, ...]}`): they travel
        without their KV."""
        skip = ExportBody.model_validate_json(body).skip_block_hashes if body else []
        snapshot = await self.engine.export_request(request_id, mode, frozenset(bytes.fromhex(h) for h in skip))
        data = await asyncio.get_running_loop().run_in_executor(None, snapshot.to_bytes)  # tens of MB: off the loop
        return Response(data, media_type="application/octet-stream")

    async def import_request(self, data: bytes, streamed: bool, raw: Request) -> JSONResponse | StreamingResponse:
        """Continue an exported request here; answered like /generate, its output including
        what it had generated before the export."""
        snapshot = await asyncio.get_running_loop().run_in_executor(None, RequestSnapshot.from_bytes, data)
        kind = RequestOutputKind.DELTA if streamed else RequestOutputKind.FINAL_ONLY
        stream = await self.engine.import_request(snapshot, output_kind=kind)
        detokenizer = (snapshot.frontend_state or {}).get("detokenizer")
        text_before = "" if detokenizer is None else detokenizer["text"][: detokenizer["num_emitted"]]
        return await self._generate_response(stream.request_id, stream, streamed, raw, text_before,
                                             tuple(snapshot.output_token_ids))

    # ----- helpers ----------------------------------------------------------------------------

    async def _add_all(self, request_id: str, prompts: list[str | TokenIds], params: SamplingParams,
                       priority: int, cache_salt: str | None, field_names: dict[str, str] | None = None,
                       kv_transfer_params: TransferParams | None = None, n: int = 1,
                       add_special_tokens: bool = True) -> list[RequestStream]:
        """Add every prompt of a request, n samples each (stream p * n + i is prompt p's sample
        i), or none: a refused one aborts those already added. A prompt's samples are separate
        engine requests; the scheduler has the later ones wait while the first computes the
        prompt, then read its blocks from the prefix cache (one prefill, not n). With a seed,
        sample i uses seed + i, as vLLM. `field_names`: the body's names of SamplingParams'
        fields, for a refusal's message. `kv_transfer_params`: the router's pairing
        (disaggregation), one room per prompt. `add_special_tokens`: for text prompts (BOS and the like)."""
        if kv_transfer_params is not None and len(prompts) * n > 1:
            raise InvalidRequestError("a disaggregated request takes one prompt and n = 1 (one bootstrap_room each)",
                                      "prompt")
        if self.log_requests:
            self._log_request(request_id, prompts, params)
        samples = [(prompt, sample) for prompt in prompts for sample in dataclasses.replace(params, n=n).samples()]
        request_ids = [f"{request_id}-{index}" if len(samples) > 1 else request_id for index in range(len(samples))]
        if self.metrics is not None and n > 1:
            for first in range(0, len(samples), n):
                self.metrics.expect_samples(request_ids[first:first + n])
        streams: list[RequestStream] = []
        try:
            for sample_id, (prompt, sample_params) in zip(request_ids, samples):
                streams.append(await self.engine.add_request(sample_id, prompt, sample_params, priority,
                                                             cache_salt=cache_salt,
                                                             kv_transfer_params=kv_transfer_params,
                                                             add_special_tokens=add_special_tokens))
        except InvalidRequestError as error:
            self._abort_added(streams, request_ids)
            renamed = rename_error(error, field_names or {})
            if renamed is error:
                raise
            raise renamed from None
        except BaseException:
            self._abort_added(streams, request_ids)
            raise
        return streams

    def _abort_added(self, streams: list[RequestStream], request_ids: list[str]) -> None:
        """A request refused part-way: the samples already added are aborted (each then counts as its own)."""
        if self.metrics is not None:
            self.metrics.forget_samples(request_ids)
        for stream in streams:
            stream.abort()

    async def _beam_search(self, request_id: str, prompts: list[str | TokenIds],
                           body: CompletionRequest | ChatCompletionRequest, params: SamplingParams,
                           **add_options: Any) -> list[RequestOutput]:
        """use_beam_search (vLLM's): each prompt's body.n best beams (chunkserve.engine.beam_search),
        as n finished outputs laid out like _add_all's streams (output p * n + i: prompt p's beam i)."""
        beam_params = body.beam_search_params(params)
        arrival = time.time()
        found = await beam_search_async(self.engine, request_id, prompts, beam_params, body.priority, body.cache_salt,
                                        "n", **add_options)
        return [RequestOutput(request_id, prompt if isinstance(prompt, str) else None,
                              beam.tokens[: beam.num_prompt_tokens],
                              [beam_completion(beam, beam_params, self.tokenizer, params.logprobs)],
                              True, RequestMetrics(arrival_time=arrival, finished_time=time.time()))
                for prompt, beams in zip(prompts, found) for beam in beams]

    def _log_request(self, request_id: str, prompts: list[str | TokenIds], params: SamplingParams) -> None:
        """--enable-log-requests: what arrived (prompts cut at --max-log-len characters or ids)."""
        cut = self.max_log_len
        shown = [p if cut is None else p[:cut] for p in prompts]
        logger.info("request %s: prompts %r, params %s", request_id, shown, params)

    def _prompt_text(self, prompt: str | TokenIds) -> str:
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def _tokens_as_ids(self, body: CompletionRequest | ChatCompletionRequest) -> bool:
        given = body.return_tokens_as_token_ids
        return self.return_tokens_as_token_ids if given is None else given

    def _token_label(self, token_id: int, as_ids: bool) -> str:
        """How logprobs name a token: its text, or vLLM's "token_id:N" (texts can be ambiguous)."""
        return f"token_id:{token_id}" if as_ids else self._token_text(token_id)

    def _completion_logprobs(self, records: list[tuple[int, TokenLogprobs | None]], as_ids: bool) -> Event:
        """OpenAI's completion logprobs; a token without a record (an echoed prompt's first) gets None."""
        texts = [self._token_text(token_id) for token_id, _ in records]
        offsets, offset = [], 0
        for text in texts:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": [self._token_label(token_id, as_ids) for token_id, _ in records],
            "token_logprobs": [None if r is None else r.logprob for _, r in records],
            "top_logprobs": [None if r is None else {self._token_label(t, as_ids): lp for t, lp in r.top}
                             for _, r in records],
            "text_offset": offsets,
        }

    def _vllm_prompt_logprobs(self, records: list[TokenLogprobs | None]) -> list[Event | None]:
        """vLLM's `prompt_logprobs`: per prompt token, None for the first, else token id -> its
        logprob, rank in the vocabulary and text, for the prompt token and the top ones."""
        return [None if record is None else
                {str(t): dataclasses.asdict(entry) for t, entry in logprob_dict(record, self._token_text).items()}
                for record in records]

    def _chat_logprob(self, record: TokenLogprobs, as_ids: bool = False) -> Event:
        def entry(token_id: int, logprob: float) -> Event:
            text = self._token_label(token_id, as_ids)
            return {"token": text, "logprob": logprob, "bytes": list(self._token_text(token_id).encode())}

        return {**entry(record.token_id, record.logprob), "top_logprobs": [entry(t, lp) for t, lp in record.top]}


def _tool_call_choices(reader: CallStream, index: int, completion: Any, finished: bool,
                       logprobs: Event | None) -> list[Event]:
    """A stream's choices for one output of a request with tools: its text read for calls
    (content and tool_calls deltas; none while the reader holds text back), the output's
    logprobs on the first, its finish_reason on the last."""
    deltas: list[Delta] = reader.feed(completion.text_delta)
    finish_reason = None
    if finished:
        rest, finish_reason = reader.finish(completion.finish_reason)
        deltas = deltas + rest or [{}]
    choices = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None,
                "stop_reason": completion.stop_reason} for delta in deltas]
    if choices:
        choices[0]["logprobs"] = logprobs
        choices[-1]["finish_reason"] = finish_reason
    return choices


def _sglang_finish_reason(completion: Any, num_tokens: int) -> Event:
    if completion.finish_reason == "length":
        return {"type": "length", "length": num_tokens}
    if completion.finish_reason == "stop":
        return {"type": "stop", "matched": completion.stop_reason}
    return {"type": "abort", "message": "aborted"}


@dataclasses.dataclass(frozen=True)
class GenerateLogprobs:
    """What a /generate prompt asks of logprobs (SGLang's return_logprob and its companions)."""

    top: int  # top_logprobs_num: the most likely tokens shown at each position
    start: int  # logprob_start_len: the first prompt position shown (-1: the prompt's last token only)
    with_text: bool  # return_text_in_logprobs: each token's text beside its id


def _logprobs_asked(body: GenerateRequest, count: int) -> list[GenerateLogprobs | None]:
    """Each prompt's logprob fields (None where return_logprob is not set)."""
    wanted = body.per_prompt("return_logprob", count, False)
    starts = body.per_prompt("logprob_start_len", count, -1)
    tops = body.per_prompt("top_logprobs_num", count, 0)
    return [GenerateLogprobs(top, start, body.return_text_in_logprobs) if want else None
            for want, start, top in zip(wanted, starts, tops)]


@dataclasses.dataclass
class _GenerateSample:
    """One /generate result as its stream's outputs come: a stream's outputs carry what is new,
    a plain response's one output everything. The shown_* lists are the logprobs already put in
    SGLang's shape."""

    request_id: str
    logprobs: GenerateLogprobs | None
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    records: list[TokenLogprobs] = dataclasses.field(default_factory=list)  # the output tokens' logprobs
    prompt_records: list[TokenLogprobs | None] | None = None
    shown_input: Event | None = None
    shown_output: list[list[Any]] = dataclasses.field(default_factory=list)
    shown_top: list[list[list[Any]]] = dataclasses.field(default_factory=list)

    def add(self, output: RequestOutput) -> _GenerateSample:
        """A stream's output (what is new)."""
        completion = output.outputs[0]
        self.text += completion.text_delta
        self.token_ids += completion.new_token_ids
        self.records += completion.new_logprobs
        self.prompt_records = output.prompt_logprobs or self.prompt_records
        return self

    def final(self, output: RequestOutput) -> _GenerateSample:
        """A plain response's only output (everything)."""
        completion = output.outputs[0]
        self.text, self.token_ids = completion.text, list(completion.token_ids)
        self.records, self.prompt_records = list(completion.logprobs or []), output.prompt_logprobs
        return self


async def _collect(streams: list[RequestStream]) -> list[RequestOutput]:
    """Each stream's final output, in order. If this is cancelled (the client hung up) or
    fails, every stream is aborted, not only the one being read."""
    finals: dict[int, RequestOutput] = {}
    try:
        async for index, output in _merge(streams):
            if output.finished:
                finals[index] = output
    finally:
        for stream in streams:
            stream.abort()
    return [finals[i] for i in range(len(streams))]


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several streams, in the order they arrive."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    # bounded: a reader that stops reading leaves the outputs in the streams' own queues, which
    # abort their requests past --max-unread-outputs
    arrivals: asyncio.Queue = asyncio.Queue(maxsize=len(streams))
    done = object()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await arrivals.put((index, output))
        except Exception as error:
            await arrivals.put((index, error))
        await arrivals.put((index, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await arrivals.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def _unless_disconnected(raw: Request, work: Awaitable[Any]) -> Any:
    """Run `work` unless the client hangs up first: then it is cancelled (its requests abort)."""
    task = asyncio.ensure_future(work)

    async def hang_up() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(hang_up())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # let its streams abort
    if task.cancelled():
        raise asyncio.CancelledError("the client disconnected")
    return task.result()


def _event_stream(events: AsyncIterator[str], streams: list[RequestStream]) -> StreamingResponse:
    """SSE; the requests are aborted if the client disconnects or an error ends the stream."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except Exception as error:  # headers are sent: report in-band, as OpenAI's API does
            yield sse(error_body(f"generation failed: {error}", "internal_error", 500))
            yield sse("[DONE]")
        finally:
            for stream in streams:
                stream.abort()

    return StreamingResponse(guarded(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

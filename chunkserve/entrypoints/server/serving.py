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
from chunkserve.core.sched.output import TokenLogprobs
from chunkserve.engine.async_llm import AsyncLLM, RequestStream
from chunkserve.engine.outputs import RequestOutput
from chunkserve.entrypoints.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GENERATE_NAMES,
    ExportBody,
    GenerateRequest,
    TokenIds,
    TokenizeRequest,
    error_body,
)
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
                 return_tokens_as_token_ids: bool = False) -> None:
        """`model_names`: what a request may name (--served-model-name); responses name the first."""
        self.engine = engine
        self.model_names = model_names
        self.model_name = model_names[0]
        self.max_prompts_per_request = max_prompts_per_request
        self.response_role = response_role
        self.log_requests = log_requests
        self.max_log_len = max_log_len
        self.return_tokens_as_token_ids = return_tokens_as_token_ids  # the server's default (a request may say)
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
            tokens = await self.engine.apply_chat_template([m.as_template_message() for m in body.messages],
                                                           body.add_generation_prompt)
        elif body.prompt is not None:
            tokens = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise InvalidRequestError("give prompt (text) or messages (a conversation)", "prompt")
        strs = self.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": self.engine.info.max_model_len, "tokens": list(tokens),
                "token_strs": strs}

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
        params = body.sampling_params(body.max_tokens, body.logprobs, self.engine.generation_defaults)
        echo_logprobs = body.echo and body.logprobs is not None  # the echoed prompt's tokens get logprobs too
        if echo_logprobs:
            params = dataclasses.replace(params, prompt_logprobs=max(body.logprobs, params.prompt_logprobs or 0))
        as_ids = self._tokens_as_ids(body)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self._add_all(request_id, prompts, params, body.priority, body.cache_salt,
                                      kv_transfer_params=body.transfer_params(), n=body.n)
        head = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        echoes = [self._prompt_text(p) if body.echo else "" for p in prompts for _ in range(body.n)]

        def choice(index: int, output: RequestOutput, text: str, logprobs: list[TokenLogprobs] | None) -> Event:
            """`output.prompt_logprobs` is set in a request's first (or only) output."""
            completion, prompt_records = output.outputs[0], output.prompt_logprobs
            records = None if logprobs is None else [(r.token_id, r) for r in logprobs]
            if records is not None and echo_logprobs and prompt_records is not None:
                records = [*zip(output.prompt_token_ids, prompt_records), *records]
            event = {
                "index": index, "text": text,
                "logprobs": None if records is None else self._completion_logprobs(records, as_ids),
                "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
            }
            if body.prompt_logprobs is not None and prompt_records is not None:
                event["prompt_logprobs"] = self._vllm_prompt_logprobs(output.prompt_token_ids, prompt_records)
            return event

        if not body.stream:
            outputs = await _unless_disconnected(raw, _collect(streams))
            choices = [choice(i, o, echoes[i] + o.outputs[0].text, o.outputs[0].logprobs) for i, o in enumerate(outputs)]
            return JSONResponse({**head, "choices": choices, "usage": usage(outputs, n=body.n)})

        async def events() -> AsyncIterator[str]:
            finals: dict[int, RequestOutput] = {}
            generated = 0
            async for index, output in _merge(streams):
                completion = output.outputs[0]
                generated += len(completion.new_token_ids)
                text = echoes[index] + completion.text_delta
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
        messages = [m.as_template_message() for m in body.messages]
        params = body.chat_sampling_params(self.engine.generation_defaults)
        prompt = await self.engine.apply_chat_template(messages, body.add_generation_prompt)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        given = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        streams = await self._add_all(request_id, [prompt], params, body.priority, body.cache_salt,
                                      {"max_tokens": given, "logprobs": "top_logprobs"}, body.transfer_params(), body.n)
        created = int(time.time())
        as_ids = self._tokens_as_ids(body)

        def logprobs_of(records: list[TokenLogprobs] | None) -> Event | None:
            return None if records is None else {"content": [self._chat_logprob(r, as_ids) for r in records]}

        if not body.stream:
            outputs = await _unless_disconnected(raw, _collect(streams))
            return JSONResponse({
                "id": request_id, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": [{
                    "index": index, "message": {"role": self.response_role, "content": completion.text},
                    "logprobs": logprobs_of(completion.logprobs),
                    "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
                } for index, completion in enumerate(o.outputs[0] for o in outputs)],
                "usage": usage(outputs, n=body.n),
                **({"prompt_logprobs": self._vllm_prompt_logprobs(outputs[0].prompt_token_ids,
                                                                  outputs[0].prompt_logprobs)}
                   if body.prompt_logprobs is not None and outputs[0].prompt_logprobs is not None else {}),
            })

        head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": self.model_name}

        async def events() -> AsyncIterator[str]:
            for index in range(body.n):
                yield sse({**head, "choices": [
                    {"index": index, "delta": {"role": self.response_role, "content": ""}, "logprobs": None,
                     "finish_reason": None}
                ]})
            finals: dict[int, RequestOutput] = {}
            generated = 0
            async for index, output in _merge(streams):
                completion = output.outputs[0]
                generated += len(completion.new_token_ids)
                logprobs = logprobs_of(completion.new_logprobs if params.logprobs is not None else None)
                yield sse({**head, "choices": [{
                    "index": index, "delta": {"content": completion.text_delta}, "logprobs": logprobs,
                    "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
                }]})
                if output.finished:
                    finals[index] = output
            if body.include_usage and finals:
                yield sse({**head, "choices": [], "usage": usage([finals[i] for i in sorted(finals)], generated,
                                                                 body.n)})
            yield sse("[DONE]")

        return _event_stream(events(), streams)

    # ----- /generate (SGLang) -----------------------------------------------------------------

    async def generate(self, body: GenerateRequest, raw: Request) -> JSONResponse | StreamingResponse:
        body.check_fields()
        body.sampling_params.check_fields()
        prompt = body.prompt()
        request_id = body.rid or f"gen-{uuid.uuid4().hex}"
        params = body.sampling_params.to_sampling_params(body.stream, self.engine.generation_defaults)
        streams = await self._add_all(request_id, [prompt], params, 0,
                                      body.cache_salt, GENERATE_NAMES, body.transfer_params())
        return await self._generate_response(request_id, streams[0], body.stream, raw)

    async def _generate_response(self, request_id: str, stream: RequestStream, streamed: bool, raw: Request,
                                 text_before: str = "", token_ids_before: tuple[int, ...] = ()
                                 ) -> JSONResponse | StreamingResponse:
        """/generate's answer (SGLang's shape). `text_before`/`token_ids_before`: the output an
        imported request had when it was exported, which a stream's events include."""

        def result(output: RequestOutput, text: str, token_ids: list[int]) -> Event:
            completion = output.outputs[0]
            metrics = output.metrics
            end = metrics.finished_time if output.finished else time.time()
            return {
                "text": text, "output_ids": token_ids,
                "meta_info": {
                    "id": request_id, "prompt_tokens": len(output.prompt_token_ids),
                    "completion_tokens": len(token_ids),
                    "cached_tokens": output.num_cached_tokens,
                    "finish_reason": _sglang_finish_reason(completion, len(token_ids)) if output.finished else None,
                    "e2e_latency": end - metrics.arrival_time,
                },
            }

        if not streamed:
            (output,) = await _unless_disconnected(raw, _collect([stream]))
            return JSONResponse(result(output, output.outputs[0].text, list(output.outputs[0].token_ids)))

        async def events() -> AsyncIterator[str]:  # SGLang streams the whole text so far in every event
            text, token_ids = text_before, list(token_ids_before)
            async for _, output in _merge([stream]):
                text += output.outputs[0].text_delta
                token_ids += output.outputs[0].new_token_ids
                yield sse(result(output, text, list(token_ids)))
            yield sse("[DONE]")

        return _event_stream(events(), [stream])

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
                       kv_transfer_params: TransferParams | None = None, n: int = 1) -> list[RequestStream]:
        """Add every prompt of a request, n samples each (stream p * n + i is prompt p's sample
        i), or none: a refused one aborts those already added. A prompt's samples are separate
        engine requests; the scheduler has the later ones wait while the first computes the
        prompt, then read its blocks from the prefix cache (one prefill, not n). With a seed,
        sample i uses seed + i, as vLLM. `field_names`: the body's names of SamplingParams'
        fields, for a refusal's message. `kv_transfer_params`: the router's pairing
        (disaggregation), one room per prompt."""
        if kv_transfer_params is not None and len(prompts) * n > 1:
            raise InvalidRequestError("a disaggregated request takes one prompt and n = 1 (one bootstrap_room each)",
                                      "prompt")
        if self.log_requests:
            self._log_request(request_id, prompts, params)
        samples = [(prompt, params if params.seed is None else dataclasses.replace(params, seed=params.seed + i))
                   for prompt in prompts for i in range(n)]
        streams: list[RequestStream] = []
        try:
            for index, (prompt, sample_params) in enumerate(samples):
                suffix = f"-{index}" if len(samples) > 1 else ""
                streams.append(await self.engine.add_request(request_id + suffix, prompt, sample_params, priority,
                                                             cache_salt=cache_salt,
                                                             kv_transfer_params=kv_transfer_params))
        except InvalidRequestError as error:
            for stream in streams:
                stream.abort()
            name = (field_names or {}).get(error.param)
            if name is None:
                raise
            raise InvalidRequestError(str(error).replace(error.param, name), name) from None
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return streams

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

    def _vllm_prompt_logprobs(self, token_ids: list[int], records: list[TokenLogprobs | None]) -> list[Event | None]:
        """vLLM's `prompt_logprobs`: per prompt token, None for the first, else token id -> its
        logprob, rank among the top ones (None when outside them) and text; the top ones too."""
        shown = []
        for token_id, record in zip(token_ids, records):
            if record is None:
                shown.append(None)
                continue
            entries = {str(t): {"logprob": lp, "rank": rank, "decoded_token": self._token_text(t)}
                       for rank, (t, lp) in enumerate(record.top, start=1)}
            entries.setdefault(str(token_id), {"logprob": record.logprob, "rank": None,
                                               "decoded_token": self._token_text(token_id)})
            shown.append(entries)
        return shown

    def _chat_logprob(self, record: TokenLogprobs, as_ids: bool = False) -> Event:
        def entry(token_id: int, logprob: float) -> Event:
            text = self._token_label(token_id, as_ids)
            return {"token": text, "logprob": logprob, "bytes": list(self._token_text(token_id).encode())}

        return {**entry(record.token_id, record.logprob), "top_logprobs": [entry(t, lp) for t, lp in record.top]}


def _sglang_finish_reason(completion: Any, num_tokens: int) -> Event:
    if completion.finish_reason == "length":
        return {"type": "length", "length": num_tokens}
    if completion.finish_reason == "stop":
        return {"type": "stop", "matched": completion.stop_reason}
    return {"type": "abort", "message": "aborted"}


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

"""The request handlers behind the routes: OpenAI completions and chat completions, and
SGLang's /generate. Each turns a validated body into engine requests and the engine's
outputs into response bodies or server-sent events (one event per sampled token)."""

from __future__ import annotations

import asyncio
import functools
import json
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
    ExportBody,
    GenerateRequest,
    TokenIds,
    error_body,
)
from chunkserve.errors import InvalidRequestError
from chunkserve.sampling_params import RequestOutputKind, SamplingParams

Event = dict[str, Any]
# SGLang's names in /generate's sampling_params for SamplingParams' fields
GENERATE_FIELDS = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "seed": "sampling_seed"}


def sse(payload: Event | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def usage(outputs: list[RequestOutput], completion_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens` counts the prompt tokens
    read from the prefix cache. `completion_tokens`: counted by a stream (its outputs carry
    only what was new), else the outputs' own."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    if completion_tokens is None:
        completion_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


class Serving:
    def __init__(self, engine: AsyncLLM, model_name: str, max_prompts_per_request: int) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_prompts_per_request = max_prompts_per_request
        self.tokenizer = engine.tokenizer
        self._token_text = functools.lru_cache(maxsize=1 << 16)(lambda t: self.tokenizer.decode([t]))

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise InvalidRequestError(f"model {model!r} does not exist; this server serves {self.model_name!r}", "model")

    # ----- /v1/completions -------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, raw: Request) -> JSONResponse | StreamingResponse:
        self.check_model(body.model)
        prompts = body.prompts()
        if len(prompts) > self.max_prompts_per_request:
            raise InvalidRequestError(f"prompt has {len(prompts)} prompts, over the limit of "
                                      f"{self.max_prompts_per_request} (--max-prompts-per-request)", "prompt")
        if body.echo and body.logprobs is not None:
            raise InvalidRequestError("echo together with logprobs is not supported", "echo")
        params = body.sampling_params(body.max_tokens, body.logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await self._add_all(request_id, prompts, params, body.priority, body.cache_salt,
                                      kv_transfer_params=body.transfer_params())
        head = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        echoes = [self._prompt_text(p) if body.echo else "" for p in prompts]

        def choice(index: int, output: RequestOutput, text: str, logprobs: list[TokenLogprobs] | None) -> Event:
            completion = output.outputs[0]
            return {
                "index": index, "text": text,
                "logprobs": None if logprobs is None else self._completion_logprobs(logprobs),
                "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
            }

        if not body.stream:
            outputs = await _unless_disconnected(raw, _collect(streams))
            choices = [choice(i, o, echoes[i] + o.outputs[0].text, o.outputs[0].logprobs) for i, o in enumerate(outputs)]
            return JSONResponse({**head, "choices": choices, "usage": usage(outputs)})

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
                yield sse({**head, "choices": [], "usage": usage(list(finals.values()), generated)})
            yield sse("[DONE]")

        return _event_stream(events(), streams)

    # ----- /v1/chat/completions -------------------------------------------------------------

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> JSONResponse | StreamingResponse:
        self.check_model(body.model)
        messages = [m.as_template_message() for m in body.messages]
        params = body.chat_sampling_params()
        prompt = await self.engine.apply_chat_template(messages, body.add_generation_prompt)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        given = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        streams = await self._add_all(request_id, [prompt], params, body.priority, body.cache_salt,
                                      {"max_tokens": given, "logprobs": "top_logprobs"}, body.transfer_params())
        created = int(time.time())

        def logprobs_of(records: list[TokenLogprobs] | None) -> Event | None:
            return None if records is None else {"content": [self._chat_logprob(r) for r in records]}

        if not body.stream:
            (output,) = await _unless_disconnected(raw, _collect(streams))
            completion = output.outputs[0]
            return JSONResponse({
                "id": request_id, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": [{
                    "index": 0, "message": {"role": "assistant", "content": completion.text},
                    "logprobs": logprobs_of(completion.logprobs),
                    "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
                }],
                "usage": usage([output]),
            })

        head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": self.model_name}

        async def events() -> AsyncIterator[str]:
            yield sse({**head, "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            ]})
            final, generated = None, 0
            async for _, output in _merge(streams):
                completion = output.outputs[0]
                generated += len(completion.new_token_ids)
                logprobs = logprobs_of(completion.new_logprobs if params.logprobs is not None else None)
                yield sse({**head, "choices": [{
                    "index": 0, "delta": {"content": completion.text_delta}, "logprobs": logprobs,
                    "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason,
                }]})
                final = output
            if body.include_usage and final is not None:
                yield sse({**head, "choices": [], "usage": usage([final], generated)})
            yield sse("[DONE]")

        return _event_stream(events(), streams)

    # ----- /generate (SGLang) -----------------------------------------------------------------

    async def generate(self, body: GenerateRequest, raw: Request) -> JSONResponse | StreamingResponse:
        prompt = body.prompt()
        request_id = body.rid or f"gen-{uuid.uuid4().hex}"
        streams = await self._add_all(request_id, [prompt], body.sampling_params.to_sampling_params(body.stream), 0,
                                      body.cache_salt, GENERATE_FIELDS, body.transfer_params())
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
                       kv_transfer_params: TransferParams | None = None) -> list[RequestStream]:
        """Add every prompt of a request, or none: a refused one aborts those already added.
        `field_names`: the body's names of SamplingParams' fields, for a refusal's message.
        `kv_transfer_params`: the router's pairing (disaggregation), one room per prompt."""
        if kv_transfer_params is not None and len(prompts) > 1:
            raise InvalidRequestError("a disaggregated request takes one prompt (one bootstrap_room each)", "prompt")
        streams: list[RequestStream] = []
        try:
            for index, prompt in enumerate(prompts):
                suffix = f"-{index}" if len(prompts) > 1 else ""
                streams.append(await self.engine.add_request(request_id + suffix, prompt, params, priority,
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

    def _prompt_text(self, prompt: str | TokenIds) -> str:
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def _completion_logprobs(self, records: list[TokenLogprobs]) -> Event:
        tokens = [self._token_text(r.token_id) for r in records]
        offsets, offset = [], 0
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [r.logprob for r in records],
            "top_logprobs": [{self._token_text(t): lp for t, lp in r.top} for r in records],
            "text_offset": offsets,
        }

    def _chat_logprob(self, record: TokenLogprobs) -> Event:
        def entry(token_id: int, logprob: float) -> Event:
            text = self._token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

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

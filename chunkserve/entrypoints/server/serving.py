"""What every API dialect's handlers share (openai_api.py, sglang_api.py, vllm_api.py): the
engine, the served model names, the server's flags that shape answers, adding a request's
prompts and samples to the engine, and reading their outputs as one response or as
server-sent events."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from chunkserve.core.disagg.protocol import TransferParams
from chunkserve.engine.async_llm import AsyncLLM, RequestStream
from chunkserve.engine.input_processor import MultiModalPrompt
from chunkserve.engine.outputs import RequestOutput
from chunkserve.entrypoints.args import ServerArgs
from chunkserve.entrypoints.server.metrics import EngineMetrics
from chunkserve.entrypoints.server.openai_protocol import ChatTemplateFields
from chunkserve.entrypoints.server.protocol import TokenIds, error_body, rename_error
from chunkserve.entrypoints.server.tool_parsers import TOOL_PARSERS, ToolParser
from chunkserve.errors import InvalidRequestError
from chunkserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
Event = dict[str, Any]


def sse(payload: Event | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


@dataclasses.dataclass(frozen=True)
class ServingOptions:
    """The server's flags that shape how requests are answered (ServerArgs' fields of these names)."""

    max_prompts_per_request: int
    response_role: str = "assistant"
    log_requests: bool = False  # --enable-log-requests
    max_log_len: int | None = None
    return_tokens_as_token_ids: bool = False  # the server's default (a request may say)
    trust_request_chat_template: bool = False  # whether a request may bring its own chat template
    # how tool_choice "auto" reads calls from the text (--tool-call-parser), None without --enable-auto-tool-choice
    tool_parser: type[ToolParser] | None = None
    exclude_tools_when_tool_choice_none: bool = False  # vLLM's flag of that name

    @classmethod
    def from_args(cls, args: ServerArgs) -> ServingOptions:
        return cls(args.max_prompts_per_request, args.response_role, args.enable_log_requests, args.max_log_len,
                   args.return_tokens_as_token_ids, args.trust_request_chat_template,
                   TOOL_PARSERS[args.tool_call_parser] if args.enable_auto_tool_choice else None,
                   args.exclude_tools_when_tool_choice_none)


class Serving:
    """The base of each dialect's handlers."""

    def __init__(self, engine: AsyncLLM, model_names: list[str], options: ServingOptions,
                 metrics: EngineMetrics | None = None) -> None:
        """`model_names`: what a request may name (--served-model-name); responses name the first.
        `metrics`: told which engine requests are the samples of one prompt."""
        self.engine = engine
        self.metrics = metrics
        self.model_names = model_names
        self.model_name = model_names[0]
        self.options = options
        self.tokenizer = engine.tokenizer
        self._token_text = functools.lru_cache(maxsize=1 << 16)(lambda t: self.tokenizer.decode([t]))

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            served = ", ".join(repr(name) for name in self.model_names)
            raise InvalidRequestError(f"model {model!r} does not exist; this server serves {served}", "model")

    def _check_template_trust(self, body: ChatTemplateFields) -> None:
        """A request's own chat template runs only on a server that trusts it (vLLM's flag and
        message): a Jinja template is code, and rendering it can take unbounded time."""
        if body.has_request_template and not self.options.trust_request_chat_template:
            raise InvalidRequestError("Chat template is passed with request, but --trust-request-chat-template is "
                                      "not set. Refused request with untrusted chat template.", "chat_template")

    async def reset_prefix_cache(self) -> dict[str, Any] | JSONResponse:
        """vLLM's /reset_prefix_cache and SGLang's /flush_cache: 409 unless the server is idle."""
        if not await self.engine.reset_prefix_cache():
            return error_response(409, "the prefix cache can only be reset while no request is running or waiting; "
                                       "retry when the server is idle", "conflict_error")
        return {}

    async def _add_all(self, request_id: str, prompts: list[str | TokenIds | MultiModalPrompt], params: SamplingParams,
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
        if self.options.log_requests:
            self._log_request(request_id, prompts, dataclasses.replace(params, n=n))
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

    def _log_request(self, request_id: str, prompts: list[str | TokenIds | MultiModalPrompt],
                     params: SamplingParams) -> None:
        """--enable-log-requests: what arrived and when (prompts cut at --max-log-len characters or
        ids; a prompt with images as its token ids and its images' identifiers). `chunkserve sim
        --from-log` reads these lines back as a request trace."""
        cut = self.options.max_log_len
        shown: list[Any] = []
        for prompt in prompts:
            if isinstance(prompt, MultiModalPrompt):
                ids = prompt.token_ids if cut is None else prompt.token_ids[:cut]
                shown.append({"token_ids": ids, "images": [f.identifier for f in prompt.features]})
            else:
                shown.append(prompt if cut is None else prompt[:cut])
        logger.info("request %s: arrived %.6f, prompts %r, params %s", request_id, time.time(), shown, params)



def error_response(status: int, message: str, error_type: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, error_type, status, param), status_code=status, headers=headers)


async def collect(streams: list[RequestStream]) -> list[RequestOutput]:
    """Each stream's final output, in order. If this is cancelled (the client hung up) or
    fails, every stream is aborted, not only the one being read."""
    finals: dict[int, RequestOutput] = {}
    try:
        async for index, output in merge(streams):
            if output.finished:
                finals[index] = output
    finally:
        for stream in streams:
            stream.abort()
    return [finals[i] for i in range(len(streams))]


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


async def unless_disconnected(raw: Request, work: Awaitable[Any]) -> Any:
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


def event_stream(events: AsyncIterator[str], streams: list[RequestStream]) -> StreamingResponse:
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

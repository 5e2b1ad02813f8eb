"""OpenAI's API: /v1/completions, /v1/chat/completions and /v1/models, with vLLM's extensions
of them (prompt_logprobs, use_beam_search, return_tokens_as_token_ids, tool calling)."""

from __future__ import annotations

import dataclasses
import functools
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from chunkserve.core.messages import TokenLogprobs
from chunkserve.engine.async_llm import RequestStream
from chunkserve.engine.beam_search import beam_search_async
from chunkserve.engine.beam_search import completion as beam_completion
from chunkserve.engine.input_processor import MultiModalPrompt
from chunkserve.engine.outputs import RequestMetrics, RequestOutput, logprob_dict
from chunkserve.entrypoints.server.access import AccessRouters
from chunkserve.entrypoints.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from chunkserve.entrypoints.server.protocol import TokenIds
from chunkserve.entrypoints.server.serving import (
    Event,
    Serving,
    collect,
    event_stream,
    merge,
    sse,
    unless_disconnected,
)
from chunkserve.entrypoints.server.tool_calls import CallStream, ChatToolCalls, Delta
from chunkserve.errors import InvalidRequestError
from chunkserve.sampling_params import SamplingParams

routers = AccessRouters()
ChoiceBuilder = Callable[[int, RequestOutput, str, "list[TokenLogprobs] | None"], Event]


def openai_serving(raw: Request) -> OpenAIServing:
    return raw.app.state.openai_serving


# Bodies are parsed in the routes (in every API module) rather than by FastAPI so that any
# Content-Type is read as JSON (curl -d sends form-encoded) and every parse error becomes one
# OpenAI error body; openapi.py documents them.
@routers.key.post("/v1/completions")
async def completions(raw: Request):
    return await openai_serving(raw).completions(CompletionRequest.model_validate_json(await raw.body()), raw)


@routers.key.post("/v1/chat/completions")
async def chat_completions(raw: Request):
    return await openai_serving(raw).chat(ChatCompletionRequest.model_validate_json(await raw.body()), raw)


@routers.key.get("/v1/models")
async def models(raw: Request):
    serving = openai_serving(raw)
    cards = [{"id": name, "object": "model", "created": 0, "owned_by": "chunkserve", "root": serving.model_name,
              "max_model_len": serving.engine.info.max_model_len} for name in serving.model_names]
    return {"object": "list", "data": cards}


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


class OpenAIServing(Serving):
    """Completions and chat completions: a body in, the engine's outputs as OpenAI's response or its chunks."""

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
        if len(prompts) * body.n > self.options.max_prompts_per_request:
            raise InvalidRequestError(f"prompt has {len(prompts)} prompts x n = {body.n} samples, over the limit of "
                                      f"{self.options.max_prompts_per_request} (--max-prompts-per-request)", "prompt")
        params = body.sampling_params(body.completion_max_tokens(), body.logprobs, self.engine.generation_defaults)
        echo_logprobs = body.echo and body.logprobs is not None  # the echoed prompt's tokens get logprobs too
        if echo_logprobs:
            params = dataclasses.replace(params, prompt_logprobs=max(body.logprobs, params.prompt_logprobs or 0))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = [] if body.use_beam_search else await self._add_all(
            request_id, prompts, params, body.priority, body.cache_salt, kv_transfer_params=body.transfer_params(),
            n=body.n, add_special_tokens=body.add_special_tokens, field_names=body.structured_outputs_names())
        head = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        echoes = [self._prompt_text(p) if body.echo else "" for p in prompts for _ in range(body.n)]
        choice = functools.partial(self._completion_choice, body, echo_logprobs, self._tokens_as_ids(body))
        if body.stream:
            return event_stream(self._completion_events(body, params, streams, head, echoes, choice), streams)
        outputs = await unless_disconnected(raw, self._beam_search(
            request_id, prompts, body, params, add_special_tokens=body.add_special_tokens)
            if body.use_beam_search else collect(streams))
        choices = [choice(i, o, echoes[i] + ("" if body.echo_only else o.outputs[0].text), o.outputs[0].logprobs)
                   for i, o in enumerate(outputs)]
        return JSONResponse({**head, "choices": choices, "usage": usage(outputs, n=body.n)})

    def _completion_choice(self, body: CompletionRequest, echo_logprobs: bool, as_ids: bool, index: int,
                           output: RequestOutput, text: str, logprobs: list[TokenLogprobs] | None) -> Event:
        """One completion choice; `output.prompt_logprobs` is set in a request's first (or only) output."""
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

    async def _completion_events(self, body: CompletionRequest, params: SamplingParams, streams: list[RequestStream],
                                 head: Event, echoes: list[str], choice: ChoiceBuilder) -> AsyncIterator[str]:
        """A streamed completion: one event per output, each prompt's echo in its first."""
        finals: dict[int, RequestOutput] = {}
        generated = 0
        async for index, output in merge(streams):
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

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> JSONResponse | StreamingResponse:
        self.check_request(body)
        self._check_template_trust(body)
        calls = ChatToolCalls(body, self.options.tool_parser)
        messages = [m.as_template_message() for m in body.messages]
        params = calls.sampling_params(body.chat_sampling_params(self.engine.generation_defaults))
        options = body.template_options(body.add_special_tokens)
        if calls.choice == "none" and self.options.exclude_tools_when_tool_choice_none:
            options["tools"] = None
        prompt = await self.engine.apply_chat_template(messages, **options)
        if body.use_beam_search and isinstance(prompt, MultiModalPrompt):
            raise InvalidRequestError("use_beam_search does not take images", "use_beam_search")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        given = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        streams = [] if body.use_beam_search else await self._add_all(
            request_id, [prompt], params, body.priority, body.cache_salt,
            {"max_tokens": given, "logprobs": "top_logprobs", **body.structured_outputs_names(),
             **calls.field_names()}, body.transfer_params(), body.n)
        head = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": self.model_name}
        logprobs_of = functools.partial(self._chat_logprobs, self._tokens_as_ids(body))
        if body.stream:
            head = {**head, "object": "chat.completion.chunk"}
            return event_stream(self._chat_events(body, params, calls, streams, head, logprobs_of), streams)
        outputs = await unless_disconnected(raw, self._beam_search(request_id, [prompt], body, params)
                                            if body.use_beam_search else collect(streams))
        answers = [(o.outputs[0], *calls.message(o.outputs[0].text, o.outputs[0].finish_reason)) for o in outputs]
        return JSONResponse({
            **head,
            "choices": [{
                "index": index, "message": {"role": self.options.response_role, **message},
                "logprobs": logprobs_of(completion.logprobs),
                "finish_reason": finish_reason, "stop_reason": completion.stop_reason,
            } for index, (completion, message, finish_reason) in enumerate(answers)],
            "usage": usage(outputs, n=body.n),
            **({"prompt_logprobs": self._vllm_prompt_logprobs(outputs[0].prompt_logprobs)}
               if body.prompt_logprobs is not None and outputs[0].prompt_logprobs is not None else {}),
        })

    async def _chat_events(self, body: ChatCompletionRequest, params: SamplingParams, calls: ChatToolCalls,
                           streams: list[RequestStream], head: Event,
                           logprobs_of: Callable[[list[TokenLogprobs] | None], Event | None]) -> AsyncIterator[str]:
        """A streamed chat completion: each choice's role, then its content (or tool call) deltas."""
        finals: dict[int, RequestOutput] = {}
        generated = 0
        readers = [calls.stream() for _ in range(body.n)] if calls.active else None
        role_sent = False
        async for index, output in merge(streams):
            if not role_sent:  # with the first output, as vLLM: a client timing its first chunk sees the TTFT
                role_sent = True
                for choice_index in range(body.n):
                    yield sse({**head, "choices": [
                        {"index": choice_index, "delta": {"role": self.options.response_role, "content": ""},
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

    def _prompt_text(self, prompt: str | TokenIds) -> str:
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def _tokens_as_ids(self, body: CompletionRequest | ChatCompletionRequest) -> bool:
        given = body.return_tokens_as_token_ids
        return self.options.return_tokens_as_token_ids if given is None else given

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

    def _chat_logprobs(self, as_ids: bool, records: list[TokenLogprobs] | None) -> Event | None:
        return None if records is None else {"content": [self._chat_logprob(r, as_ids) for r in records]}

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


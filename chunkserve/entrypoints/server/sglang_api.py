"""SGLang's native API: /generate (its logprob and finish-reason shapes), /get_model_info,
/get_server_info, /abort_request, /health_generate and /flush_cache; and the request snapshots
(/export_request, /import_request), whose continued request is answered like /generate."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from chunkserve.config.engine import EngineArgs
from chunkserve.core.kv.snapshot import RequestSnapshot
from chunkserve.core.messages import TokenLogprobs
from chunkserve.engine.async_llm import RequestStream
from chunkserve.engine.outputs import RequestOutput
from chunkserve.entrypoints.args import ServerArgs
from chunkserve.entrypoints.server.access import AccessRouters
from chunkserve.entrypoints.server.protocol import TokenIds
from chunkserve.entrypoints.server.serving import Event, Serving, collect, event_stream, merge, sse, unless_disconnected
from chunkserve.entrypoints.server.sglang_protocol import (
    GENERATE_NAMES,
    AbortRequest,
    ExportBody,
    GenerateRequest,
    GenerateSamplingParams,
)
from chunkserve.errors import EngineDeadError, InvalidRequestError
from chunkserve.sampling_params import RequestOutputKind, SamplingParams
from chunkserve.version import VERSION

HEALTH_GENERATE_TIMEOUT_S = 20.0
# /get_server_info's fields: an allowlist, so a new flag (a key, a path to credentials) is not
# shown until it is added here. Clients read some of them (dtype, served_model_name, and the
# max_model_len and cpu_threads added beside them); the API keys are never on it.
SHOWN_ENGINE_ARGS = (
    "model", "tokenizer", "dtype", "int8_activations", "max_model_len", "chat_template", "generation_config",
    "max_logprobs", "max_num_batched_tokens", "max_num_seqs", "enable_chunked_prefill", "enable_mixed_batch",
    "long_prefill_token_threshold", "max_num_partial_prefills", "max_long_partial_prefills", "chunk_align",
    "chunk_schedule", "tbt_slo_ms", "max_prefill_wait_ms", "ttft_slo_ms", "block_size", "kv_cache_memory_gb",
    "kv_cache_memory_bytes", "num_kv_blocks", "enable_prefix_caching", "scheduling_policy",
    "enable_hierarchical_cache", "hicache_storage_backend", "hicache_storage_dir", "hicache_storage_max_gb",
    "hicache_write_policy", "disaggregation_mode", "disaggregation_transfer_backend",
    "disaggregation_bootstrap_port", "disaggregation_bootstrap_host", "disaggregation_bootstrap_timeout",
    "disaggregation_waiting_timeout", "disaggregation_heartbeat_interval",
    "disaggregation_heartbeat_max_failures", "disaggregation_kv_lease_timeout",
    "disaggregation_transfer_window", "tensor_parallel_size", "pipeline_parallel_size", "pp_layer_partition",
    "distributed_executor_backend", "nnodes", "node_rank", "master_addr", "master_port", "op_backend", "deterministic",
    "cpu_omp_threads_bind", "speculative_config", "structured_outputs_config", "seed", "max_prompt_chars",
    "max_stop_sequences", "max_stop_sequence_chars", "max_stop_token_ids", "max_logit_bias", "limit_mm_per_prompt",
    "allowed_media_domains", "max_image_bytes", "max_image_pixels",
)
SHOWN_SERVER_ARGS = (
    "host", "port", "served_model_name", "protect_metrics", "max_waiting_requests", "max_request_body_bytes",
    "max_prompts_per_request", "max_unread_outputs", "request_read_timeout", "restart_engine_on_failure",
    "shutdown_timeout", "log_level", "uvicorn_log_level", "disable_uvicorn_access_log", "enable_log_requests",
    "max_log_len", "disable_log_stats", "allowed_origins", "allowed_methods", "allowed_headers",
    "allow_credentials", "root_path", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs",
    "disable_fastapi_docs", "response_role", "return_tokens_as_token_ids", "trust_request_chat_template",
    "enable_auto_tool_choice", "tool_call_parser", "exclude_tools_when_tool_choice_none", "trace_steps",
    "headless", "disable_frontend_multiprocessing",
)
routers = AccessRouters()


def sglang_serving(raw: Request) -> SGLangServing:
    return raw.app.state.sglang_serving


@routers.key.post("/generate")
async def generate(raw: Request):
    return await sglang_serving(raw).generate(GenerateRequest.model_validate_json(await raw.body()), raw)


@routers.admin.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(raw: Request):
    """SGLang's name for /reset_prefix_cache (an admin endpoint here too)."""
    return await sglang_serving(raw).reset_prefix_cache()


@routers.key.get("/get_model_info")
async def get_model_info(raw: Request):
    serving, engine_args = sglang_serving(raw), raw.app.state.engine_args
    model_name = serving.engine.info.model_name
    return {"model_path": engine_args.model or model_name,
            "tokenizer_path": engine_args.tokenizer or engine_args.model or model_name,
            "is_generation": True, "served_model_names": serving.model_names}


@routers.key.get("/get_server_info")
async def get_server_info(raw: Request):
    """The launch settings (keys left out) and the engine's limits, as SGLang's endpoint."""
    info = sglang_serving(raw).engine.info
    return {**shown_settings(raw.app.state.engine_args, raw.app.state.server_args), "version": VERSION,
            "max_model_len": info.max_model_len, "cpu_threads": info.cpu_threads}


@routers.key.post("/abort_request")
async def abort_request(raw: Request):
    """SGLang's: abort the request with this rid (/generate's rid), or every request with abort_all."""
    body, engine = AbortRequest.model_validate_json(await raw.body()), sglang_serving(raw).engine
    if body.abort_all:
        engine.abort_all()
    elif body.rid:
        engine.abort(body.rid)
    else:
        raise InvalidRequestError("give rid (a request id) or abort_all: true", "rid")
    return {}


@routers.key.get("/health_generate")
async def health_generate(raw: Request):
    """SGLang's deep health check: the engine generates one token within a time limit."""
    return await sglang_serving(raw).health_generate(HEALTH_GENERATE_TIMEOUT_S)


@routers.admin.post("/export_request")
async def export_request(raw: Request, rid: str, mode: Literal["copy", "pause"] = "copy"):
    """A request in flight as a snapshot (application/octet-stream) that /import_request on a
    server of the same model continues; `pause` ends it here (finish_reason "abort")."""
    return await sglang_serving(raw).export_request(rid, mode, await raw.body())


@routers.admin.post("/import_request")
async def import_request(raw: Request, stream: bool = False):
    """Continue a request from /export_request's bytes (the body); answered like /generate."""
    return await sglang_serving(raw).import_request(await raw.body(), stream, raw)


def shown_settings(engine_args: EngineArgs, server_args: ServerArgs) -> dict[str, Any]:
    """The launch settings on the allowlists (SHOWN_*_ARGS), the engine's then the server's (a nested
    config as a dict)."""
    engine = dataclasses.asdict(engine_args)
    server = dataclasses.asdict(server_args)
    return {**{name: engine[name] for name in SHOWN_ENGINE_ARGS if name in engine},
            **{name: server[name] for name in SHOWN_SERVER_ARGS if name in server}}


class SGLangServing(Serving):
    """/generate in SGLang's shapes, its deep health check, and the request snapshots."""

    async def health_generate(self, timeout_s: float) -> dict[str, Any]:
        """One greedy token through the whole engine; EngineDeadError (503) if it does not come in time."""
        params = SamplingParams(max_tokens=1, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY)
        (stream,) = await self._add_all(f"health-{uuid.uuid4().hex}", [[0]], params, 0, None)
        try:
            await asyncio.wait_for(collect([stream]), timeout_s)
        except asyncio.TimeoutError:
            stream.abort()
            raise EngineDeadError(f"the engine did not generate a token within {timeout_s:g} s") from None
        return {}

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
        if count * n > self.options.max_prompts_per_request:
            raise InvalidRequestError(f"{field} has {count} prompts x n = {n} samples, over the limit of "
                                      f"{self.options.max_prompts_per_request} (--max-prompts-per-request)", field)
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
            outputs = await unless_disconnected(raw, collect(streams))
            results = [self._generate_result(sample.final(output), output) for sample, output in zip(samples, outputs)]
            return JSONResponse(results if batch else results[0])

        async def events() -> AsyncIterator[str]:
            async for index, output in merge(streams):
                result = self._generate_result(samples[index].add(output), output)
                yield sse({**result, "index": index} if batch else result)
            yield sse("[DONE]")

        return event_stream(events(), streams)

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



"""vLLM's endpoints beside the OpenAI API (/tokenize, /detokenize, /health, /ping, /load,
/version, /metrics, /reset_prefix_cache) and chunkserve's own operational ones (/server_info
for the router, /debug/steps and /debug/check)."""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from chunkserve.engine.input_processor import MultiModalPrompt
from chunkserve.entrypoints.server.access import AccessRouters
from chunkserve.entrypoints.server.serving import Serving
from chunkserve.entrypoints.server.vllm_protocol import DetokenizeRequest, TokenizeRequest
from chunkserve.errors import EngineDeadError, InvalidRequestError
from chunkserve.version import VERSION

routers = AccessRouters()


def vllm_serving(raw: Request) -> VLLMServing:
    return raw.app.state.vllm_serving


@routers.key.post("/tokenize")
async def tokenize(raw: Request):
    return await vllm_serving(raw).tokenize(TokenizeRequest.model_validate_json(await raw.body()))


@routers.key.post("/detokenize")
async def detokenize(raw: Request):
    return await vllm_serving(raw).detokenize(DetokenizeRequest.model_validate_json(await raw.body()))


@routers.open.get("/health")
async def health(raw: Request):
    if not vllm_serving(raw).engine.is_running:
        raise EngineDeadError("the engine is not running")
    return {}


@routers.open.api_route("/ping", methods=["GET", "POST"])
async def ping(raw: Request):
    """SageMaker's health check (vLLM serves it): /health's answer."""
    return await health(raw)


@routers.key.get("/load")
async def load(raw: Request):
    """Requests in flight (vLLM's server load): what a load balancer spreads by."""
    return {"server_load": vllm_serving(raw).engine.num_requests_in_flight}


@routers.open.get("/version")
async def version(raw: Request):
    """vLLM's endpoint, which routers take for "a vLLM server": SMG then pairs a prefill and a
    decode instance by vLLM's protocol (the prefill request alone, then the decode one). A prefill
    or decode instance speaks SGLang's (bootstrap_room to both at once), so it answers 404 here
    and SMG, finding /server_info, pairs it as SGLang's; /server_info carries the version."""
    mode = raw.app.state.engine_args.disaggregation_mode
    if mode != "null":
        raise HTTPException(404, f"/version is not served by a {mode} instance: it speaks SGLang's prefill/decode "
                                 "protocol, not vLLM's, and routers read /version as vLLM's (see /server_info)")
    return {"version": VERSION}


@routers.open.get("/server_info")
async def server_info(raw: Request):
    """What a router needs to know of this instance (open, like /health)."""
    serving, engine_args = vllm_serving(raw), raw.app.state.engine_args
    mode, backend = engine_args.disaggregation_mode, engine_args.disaggregation_transfer_backend
    return {"model": serving.model_name, "version": VERSION, "max_model_len": serving.engine.info.max_model_len,
            "disaggregation_mode": mode, "disaggregation_transfer_backend": None if mode == "null" else backend,
            "disaggregation_bootstrap_port": engine_args.disaggregation_bootstrap_port if mode == "prefill" else None}


@routers.metrics.get("/metrics")
async def prometheus_metrics(raw: Request):
    serving = vllm_serving(raw)
    serving.metrics.observe_frontend(serving.engine.num_unread_aborts)
    return Response(serving.metrics.render(), media_type=CONTENT_TYPE_LATEST)


@routers.admin.post("/reset_prefix_cache")
async def reset_prefix_cache(raw: Request):
    return await vllm_serving(raw).reset_prefix_cache()


@routers.admin.get("/debug/steps")
async def debug_steps(raw: Request, last: int = 100):
    if last < 1:
        raise InvalidRequestError(f"last must be at least 1, got {last}", "last")
    records = list(vllm_serving(raw).engine.step_records)[-last:]  # list() of a deque is atomic under the GIL
    return {"steps": [record.to_dict() for record in records]}


@routers.admin.get("/debug/check")
async def debug_check(raw: Request):
    """The engine's self-check: ok when idle with every KV block free or cached and no request left."""
    return await vllm_serving(raw).engine.check()


@routers.admin.get("/debug/kv_cache_blocks")
async def debug_kv_cache_blocks(raw: Request):
    """Every cached block by medium (`GPU`: the KV pool; `STORAGE`: the disk tier), as KV events
    name them (--kv-events-config): what a KV-aware router's index of this server must hold."""
    return await vllm_serving(raw).engine.cached_blocks()


class VLLMServing(Serving):
    """/tokenize and /detokenize (vLLM's bodies and answers)."""

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        body.check_fields()
        if body.messages is not None:
            if body.prompt is not None:
                raise InvalidRequestError("give prompt or messages, not both", "prompt")
            self._check_template_trust(body)
            prompt = await self.engine.apply_chat_template(
                [m.as_template_message() for m in body.messages],
                **body.template_options(bool(body.add_special_tokens)))
            tokens = prompt.token_ids if isinstance(prompt, MultiModalPrompt) else prompt  # images expanded
        elif body.prompt is not None:
            tokens = self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
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


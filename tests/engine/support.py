"""Helpers shared by the tests of tests/engine/ (support, not a test module)."""

from __future__ import annotations

import torch

from chunkserve import LLM, SamplingParams
from chunkserve.config.limits import RequestLimits
from chunkserve.config.model import resolve_model
from chunkserve.engine.core import EngineCore
from chunkserve.engine.input_processor import InputProcessor
from chunkserve.engine.messages import EngineCoreRequest, EngineInfo


def assert_pool_free(llm: LLM) -> None:
    kv = llm.engine.engine_core.scheduler.kv
    assert kv.num_free_blocks == kv.num_blocks, "KV blocks leaked"


def healthy_requests() -> list[EngineCoreRequest]:
    """Four greedy requests and four seeded sampling ones (their generators must not be disturbed)."""
    requests = []
    for i, prompt in enumerate(PROMPTS):
        params = (SamplingParams(max_tokens=10, temperature=0, ignore_eos=True) if i % 2 == 0 else
                  SamplingParams(max_tokens=10, temperature=0.9, seed=100 + i, ignore_eos=True))
        requests.append(EngineCoreRequest(f"healthy-{i}", prompt, params, None, arrival_time=float(i)))
    return requests


def run(core: EngineCore, requests: list[EngineCoreRequest]) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Every request's tokens, and the error of each one the engine failed."""
    for request in requests:
        core.add_request(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    errors: dict[str, str] = {}
    steps = 0
    while core.has_unfinished_requests():
        steps += 1
        assert steps < 500, "the engine does not make progress"
        step = core.step()
        for output in [] if step is None else step.outputs:
            tokens[output.request_id] += output.new_token_ids
            if output.error is not None:
                errors[output.request_id] = output.error
    report = core.check()
    assert report["ok"], report
    return tokens, errors


def save_tiny_llama(folder, tokenizer):
    """A tiny random Llama (conftest's config) saved in `folder` with `tokenizer`; returns transformers' model."""
    from transformers import AutoModelForCausalLM

    from tests.conftest import tiny_hf_config

    config = tiny_hf_config("llama")
    config.vocab_size = len(tokenizer)
    config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


PROMPTS = [[1000 + 37 * i + j for j in range(5 + 3 * i)] for i in range(8)]


def processor(tokenizer) -> InputProcessor:
    limits = RequestLimits(max_prompt_chars=LIMIT, max_stop_sequences=4, max_stop_sequence_chars=64,
                           max_stop_token_ids=4, max_logit_bias=4)
    return InputProcessor(tokenizer, resolve_model(None), EngineInfo("m", 2048, len(tokenizer)), limits)


LIMIT = 4096

"""The offline API, shaped like vLLM's: `LLM(model).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from chunkserve.config import EngineArgs
from chunkserve.engine.llm_engine import LLMEngine
from chunkserve.engine.outputs import RequestOutput, StepRecord
from chunkserve.errors import InvalidRequestError
from chunkserve.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int] | dict[str, Any]  # text, token ids, or vLLM's {"prompt": ...} / {"prompt_token_ids": ...}
Message = dict[str, str]


class LLM:
    """Generate for a batch of prompts at once; every engine knob is a keyword argument
    (see EngineArgs: max_num_batched_tokens, enable_chunked_prefill, ...)."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()
        # when this LLM is collected, or at exit: a disk KV tier keeps what the pool still holds
        weakref.finalize(self, self.engine.shutdown)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses without sampling_params: the model's generation config
        (--generation-config, as vLLM), else SamplingParams' own defaults."""
        return SamplingParams(**self.engine.generation_defaults)

    def get_step_records(self) -> list[StepRecord]:
        return list(self.engine.step_records)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing done) while requests are unfinished."""
        return self.engine.reset_prefix_cache()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """One finished output per prompt, in the prompts' order. A prompt is a string, a list of
        token ids, or vLLM's dict: {"prompt": text} or {"prompt_token_ids": ids}."""
        prompt_list = [_unwrap(p) for p in _as_prompt_list(prompts)]
        params = _per_prompt(sampling_params or self.get_default_sampling_params(), len(prompt_list),
                             "sampling_params")
        # only each request's last output is kept: the ones before it need not carry its history
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        priorities = _per_prompt(list(priority) if priority is not None else 0, len(prompt_list), "priority")
        request_ids = [f"offline-{next(self._ids)}" for _ in prompt_list]
        try:
            for request_id, prompt, p, prio in zip(request_ids, prompt_list, params, priorities):
                self.engine.add_request(request_id, prompt, p, priority=prio)
        except Exception:
            self.engine.abort_request(request_ids)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True) -> list[int]:
        return self.engine.input_processor.apply_chat_template(messages, add_generation_prompt)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm or len(request_ids) < 2) as bar:
            try:
                while len(finished) < len(wanted):
                    for output in self.engine.step():
                        if output.finished and output.request_id in wanted:
                            finished[output.request_id] = output
                            bar.update(1)
            except BaseException:  # a request failed, or the caller interrupted: the batch's others stop too
                self.engine.abort_request([i for i in request_ids if i not in finished])
                raise
        return [finished[request_id] for request_id in request_ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise InvalidRequestError("prompt is empty: got an empty list, neither token ids nor prompts")
    if all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _unwrap(prompt: Prompt) -> str | list[int]:
    """vLLM's TextPrompt / TokensPrompt dicts -> the text or the token ids."""
    if not isinstance(prompt, dict):
        return prompt
    known = {"prompt", "prompt_token_ids"}
    if len(known & prompt.keys()) != 1 or prompt.keys() - known - {"multi_modal_data", "mm_processor_kwargs"}:
        raise InvalidRequestError(f"a prompt dict takes exactly one of 'prompt' (text) and 'prompt_token_ids', got "
                                  f"keys {sorted(prompt)}")
    if prompt.get("multi_modal_data") or prompt.get("mm_processor_kwargs"):
        raise InvalidRequestError("multimodal inputs are not supported")
    return prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise InvalidRequestError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count

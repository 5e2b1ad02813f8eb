"""The offline API, shaped like vLLM's: `LLM(model).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from tqdm import tqdm

from chunkserve.config import EngineArgs
from chunkserve.engine import beam_search as beams
from chunkserve.engine.beam_search import BeamSearchOutput
from chunkserve.engine.chat_content import ImageItem
from chunkserve.engine.input_processor import InputProcessor, MultiModalPrompt
from chunkserve.engine.llm_engine import LLMEngine
from chunkserve.engine.outputs import RequestOutput, StepRecord, logprob_dict
from chunkserve.errors import InvalidRequestError
from chunkserve.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

# text, token ids, vLLM's {"prompt": ...} / {"prompt_token_ids": ...} (with "multi_modal_data": {"image": ...}),
# or a chat's prompt with its images expanded
Prompt = str | list[int] | dict[str, Any] | MultiModalPrompt
Message = dict[str, Any]  # role and content; an assistant's tool_calls, a tool message's tool_call_id


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
        """One finished output per prompt, in the prompts' order, shaped like vLLM's: the
        prompt's n samples as `outputs` (index 0..n-1; they are separate engine requests that
        read the prompt's KV blocks from the prefix cache once the first computed them), logprobs
        and prompt_logprobs as dicts token id -> Logprob, cumulative_logprob with logprobs. A
        prompt is a string, a list of token ids, or vLLM's dict: {"prompt": text} or
        {"prompt_token_ids": ids}; {"prompt": text, "multi_modal_data": {"image": image or [images]}}
        gives PIL images whose placeholders the text holds (the model's, e.g. "<image>")."""
        prompt_list = [engine_prompt(p, self.engine.input_processor) for p in _as_prompt_list(prompts)]
        params = _per_prompt(sampling_params or self.get_default_sampling_params(), len(prompt_list),
                             "sampling_params")
        priorities = _per_prompt(list(priority) if priority is not None else 0, len(prompt_list), "priority")
        samples = [p.samples() for p in params]
        finals = iter(self._generate([prompt for prompt, s in zip(prompt_list, samples) for _ in s],
                                     [sample for s in samples for sample in s],
                                     [prio for prio, s in zip(priorities, samples) for _ in s], use_tqdm))
        token_text = self._token_texts()
        return [_vllm_output([next(finals) for _ in s], token_text) for s in samples]

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """vLLM's beam search (chunkserve.engine.beam_search): each prompt's best
        params.beam_width sequences, best first. As in vLLM, a sequence's `tokens` and `text`
        include the prompt's, and its `logprobs` are each step's dict (the step's sampled token
        and top 2 * beam_width)."""
        prompt_list = [engine_prompt(p, self.engine.input_processor) for p in _as_prompt_list(prompts)]
        if any(isinstance(p, MultiModalPrompt) for p in prompt_list):
            raise InvalidRequestError("beam search does not take images")
        engine, step = self.engine, params.step_params()
        search = beams.search(prompt_list, params, engine.input_processor.eos_token_id, engine.max_model_len,
                              engine.input_processor.limits.max_logprobs)
        with tqdm(desc="Beam search", unit="step", disable=not use_tqdm) as bar:
            def run(batch: list[str | list[int]]) -> list[RequestOutput]:
                bar.update(1)
                return self._generate(batch, [step] * len(batch), [0] * len(batch), use_tqdm=False)

            found = beams.run_sync(search, run)
        token_text = self._token_texts()
        for beam in itertools.chain.from_iterable(found):
            beam.text = self.get_tokenizer().decode(beam.tokens)
            beam.logprobs = [logprob_dict(record, token_text) for record in beam.records]
        return [BeamSearchOutput(beams) for beams in found]

    def _token_texts(self) -> Callable[[int], str]:
        """Token id -> its text (Logprob.decoded_token), each decoded once per call."""
        tokenizer = self.get_tokenizer()
        return functools.lru_cache(maxsize=None)(lambda token_id: tokenizer.decode([token_id]))

    def _generate(self, prompts: list[str | list[int] | MultiModalPrompt], params: list[SamplingParams],
                  priorities: list[int], use_tqdm: bool) -> list[RequestOutput]:
        """Each request's finished output as the engine makes it (its logprobs as records)."""
        request_ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for request_id, prompt, p, prio in zip(request_ids, prompts, params, priorities):
                # only each request's last output is kept: the ones before it need not carry its history
                self.engine.add_request(request_id, prompt, dataclasses.replace(
                    p, output_kind=RequestOutputKind.FINAL_ONLY), priority=prio)
        except Exception:
            self.engine.abort_request(request_ids)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(self, messages: list[Message] | list[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, *, chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate. vLLM's
        names; keyword-only after use_tqdm because vLLM's order has lora_request and others there,
        which a positional call must not silently fill. See `apply_chat_template`. As in vLLM, the
        answers are not read for tool calls (the server's --tool-call-parser does that). Message
        contents may be lists of OpenAI's parts: text, image_url (data: URLs, file:// under
        allowed_local_media_path) and vLLM's image_pil."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt, chat_template=chat_template,
                                            continue_final_message=continue_final_message, tools=tools,
                                            chat_template_kwargs=chat_template_kwargs) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True, *,
                            chat_template: str | None = None, continue_final_message: bool = False,
                            tools: list[dict[str, Any]] | None = None,
                            chat_template_kwargs: dict[str, Any] | None = None) -> list[int] | MultiModalPrompt:
        """A conversation's prompt token ids, as `chat` makes them (with its images expanded, a
        MultiModalPrompt, where its messages have image_url or image_pil parts): `chat_template` in
        place of the model's, `chat_template_kwargs` passed to the template (over the other
        arguments, as in vLLM), `continue_final_message` leaving the last message open for the model
        to continue (with add_generation_prompt=False), `tools` (OpenAI's function tools) for
        templates that render them. Raises InvalidRequestError naming a bad argument."""
        return self.engine.input_processor.apply_chat_template(
            messages, add_generation_prompt, continue_final_message=continue_final_message,
            chat_template=chat_template, chat_template_kwargs=chat_template_kwargs, tools=tools)

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


def _vllm_output(samples: list[RequestOutput], token_text: Callable[[int], str]) -> RequestOutput:
    """A prompt's samples (the engine's finished outputs) -> vLLM's RequestOutput: one, with
    every sample as an output, records as Logprob dicts. The prompt's own fields (cached tokens,
    prompt_logprobs, metrics) are its first sample's, the one that computed the prompt."""
    first = samples[0]
    completions = []
    for index, sample in enumerate(samples):
        completion = sample.outputs[0]
        records = completion.logprobs
        completions.append(dataclasses.replace(
            completion, index=index,
            logprobs=None if records is None else [logprob_dict(r, token_text) for r in records],
            cumulative_logprob=None if records is None else sum(r.logprob for r in records)))
    prompt_logprobs = None if first.prompt_logprobs is None else [
        None if r is None else logprob_dict(r, token_text) for r in first.prompt_logprobs]
    return dataclasses.replace(first, outputs=completions, prompt_logprobs=prompt_logprobs)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict, MultiModalPrompt)):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise InvalidRequestError("prompt is empty: got an empty list, neither token ids nor prompts")
    if all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def engine_prompt(prompt: Prompt, input_processor: InputProcessor) -> str | list[int] | MultiModalPrompt:
    """vLLM's TextPrompt / TokensPrompt dicts -> the text or the token ids; a text with
    multi_modal_data -> the prompt with its images expanded by the model's processor."""
    if not isinstance(prompt, dict):
        return prompt
    known = {"prompt", "prompt_token_ids"}
    if len(known & prompt.keys()) != 1 or prompt.keys() - known - {"multi_modal_data", "mm_processor_kwargs"}:
        raise InvalidRequestError(f"a prompt dict takes exactly one of 'prompt' (text) and 'prompt_token_ids' "
                                  f"(and multi_modal_data), got keys {sorted(prompt)}")
    if prompt.get("mm_processor_kwargs"):
        raise InvalidRequestError("mm_processor_kwargs is not supported: the model's processor runs with the "
                                  "model folder's settings", "mm_processor_kwargs")
    if not prompt.get("multi_modal_data"):
        return prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]
    images = _images_of(prompt["multi_modal_data"])
    if "prompt" not in prompt:
        input_processor.check_images(images)  # a text-only model's refusal first
        raise InvalidRequestError("multi_modal_data needs a text prompt holding the images' placeholders, not "
                                  "prompt_token_ids", "prompt_token_ids")
    return input_processor.expand_images(prompt["prompt"], images)


def _images_of(data: Any) -> list[ImageItem]:
    """vLLM's multi_modal_data: {"image": a PIL image or a list of them}."""
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise InvalidRequestError("multi_modal_data takes {'image': a PIL image or a list of them}; other "
                                  f"modalities are not supported, got {data!r:.80}", "multi_modal_data")
    images = data.get("image")
    images = images if isinstance(images, (list, tuple)) else [images]
    return [ImageItem(f"multi_modal_data.image[{index}]", image=image) for index, image in enumerate(images)]


def _per_prompt(value: Any, count: int, name: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise InvalidRequestError(f"{name} has {len(value)} entries for {count} prompts")
        return list(value)
    return [value] * count

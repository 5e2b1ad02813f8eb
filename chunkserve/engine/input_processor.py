"""The frontend's side of a new request: text (or a conversation, through the model's chat
template) to token ids, parameters resolved and checked against the engine's limits, before
anything reaches the engine core. Sizes are checked against `RequestLimits` before any work is
done for them: a prompt over the character limit is refused without being tokenized. A prompt
with images (a chat's image parts, the offline API's multi_modal_data) is checked against
--limit-mm-per-prompt, its images loaded and checked (engine/media.py), and the model's
processor expands each image into its placeholder tokens, which count against max_model_len
like any other prompt token."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

from chunkserve.config.limits import RequestLimits
from chunkserve.config.model import ModelSource
from chunkserve.config.multimodal import MultiModalConfig
from chunkserve.config.structured_outputs import StructuredOutputsConfig
from chunkserve.core.disagg.protocol import TransferParams
from chunkserve.core.multimodal import MultiModalFeature
from chunkserve.core.structured import grammar
from chunkserve.engine.chat_content import ImageItem, content_chars, split_images
from chunkserve.engine.media import MediaLoader
from chunkserve.engine.messages import EngineCoreRequest, EngineInfo
from chunkserve.errors import InvalidRequestError
from chunkserve.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class MultiModalPrompt:
    """A prompt whose images the model's processor has expanded: its token ids, each image's
    placeholder tokens among them, and one feature per image, in prompt order."""

    token_ids: list[int]
    features: list[MultiModalFeature]


Prompt = str | list[int] | MultiModalPrompt


def resolve_max_tokens(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """A request's max_tokens (None: what max_model_len leaves), or an InvalidRequestError when the
    prompt and its output cannot fit: what the server answers 400 (the simulator refuses alike)."""
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequestError(
            f"prompt has {num_prompt_tokens} tokens, but max_model_len is {max_model_len} "
            "(prompt and output must fit, with at least one output token)", "prompt"
        )
    if max_tokens is None:
        max_tokens = max_model_len - num_prompt_tokens
    if num_prompt_tokens + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = "
            f"{num_prompt_tokens + max_tokens} exceeds max_model_len ({max_model_len}, which the KV pool can hold)",
            "max_tokens",
        )
    return max_tokens


class InputProcessor:
    def __init__(self, tokenizer: Any, source: ModelSource, info: EngineInfo, limits: RequestLimits,
                 disaggregation_mode: str = "null",
                 structured_outputs: StructuredOutputsConfig | None = None,
                 multimodal: MultiModalConfig | None = None, mm_processor: Any = None) -> None:
        """`structured_outputs`: the server's defaults for requests' structured outputs
        (--structured-outputs-config). `mm_processor`: the model's MultiModalProcessor (None: a
        text-only model); `multimodal`: where images may come from and how many (the flags)."""
        self.tokenizer = tokenizer
        self.multimodal = multimodal or MultiModalConfig()
        self.media = MediaLoader(self.multimodal)
        self.mm_processor = mm_processor
        self.disaggregation_mode = disaggregation_mode
        self.structured_outputs = structured_outputs or StructuredOutputsConfig()
        self.info = info
        self.limits = limits
        self.eos_token_id, self.extra_stop_ids = eos_ids(tokenizer, source)

    def process(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                priority: int = 0, arrival_time: float | None = None,
                cache_salt: str | None = None, kv_transfer_params: TransferParams | None = None,
                add_special_tokens: bool = True) -> tuple[EngineCoreRequest, str | None]:
        """The request for the core and the prompt's text (None for a token-id prompt).
        Raises InvalidRequestError naming what is wrong. `add_special_tokens`: whether a text
        prompt is encoded with BOS and the like (vLLM's completions field). `cache_salt`: only
        requests with the same salt share prefix-cache blocks. `kv_transfer_params`: the router's pairing, which a
        disaggregated instance needs (a monolithic one ignores it); a prefill instance computes
        the prompt and samples only the first token, checked against the client's max_tokens
        all the same, so that it refuses what its decode instance refuses. A MultiModalPrompt
        (`expand_images`, `apply_chat_template`) carries its images as the request's mm_features."""
        if self.disaggregation_mode == "null":
            kv_transfer_params = None
        elif kv_transfer_params is None:
            raise InvalidRequestError(
                f"this is the {self.disaggregation_mode} instance of a prefill/decode disaggregated deployment: send "
                "requests to its router (chunkserve router --pd-disaggregation), which pairs them with "
                "bootstrap_room, bootstrap_host and bootstrap_port", "bootstrap_room")
        params = params or SamplingParams()
        if params.n != 1:
            raise InvalidRequestError(f"n is {params.n}, but an engine request is one sample: LLM.generate and the "
                                      "server add one request per sample (SamplingParams.samples())", "n")
        self._check_sizes(params)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError("cache_salt must be a non-empty string", "cache_salt")
        if params.prompt_logprobs is not None and self.disaggregation_mode != "null":
            raise InvalidRequestError("prompt_logprobs is not supported by a prefill/decode disaggregated "
                                      "deployment: the prompt is computed on another instance", "prompt_logprobs")
        params = self._structured_outputs(params)
        features = self._check_features(prompt, params)
        text, token_ids = self._tokenize(prompt, add_special_tokens)
        token_ids = self._truncate(token_ids, params.truncate_prompt_tokens)
        params = self._resolve_params(params, len(token_ids))
        if self.disaggregation_mode == "prefill":
            params = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            kv_transfer_params=kv_transfer_params,
            mm_features=features,
        )
        return request, text

    def _check_features(self, prompt: Prompt, params: SamplingParams) -> list[MultiModalFeature]:
        """A prompt's images, refused where a feature cannot take them yet."""
        if not isinstance(prompt, MultiModalPrompt) or not prompt.features:
            return []
        if self.disaggregation_mode != "null":
            raise InvalidRequestError("images are not supported with prefill/decode disaggregation yet", "messages")
        if params.truncate_prompt_tokens is not None:
            raise InvalidRequestError("truncate_prompt_tokens cannot be combined with images: it could cut an "
                                      "image's placeholder tokens", "truncate_prompt_tokens")
        return list(prompt.features)

    def expand_images(self, text: str, images: list[ImageItem], field: str = "prompt") -> MultiModalPrompt:
        """A text prompt holding one image placeholder per image (as the chat template writes
        them) -> its token ids with the images expanded, and their features. The images are
        counted (--limit-mm-per-prompt) before any is loaded; each is loaded and checked
        (engine/media.py). Raises InvalidRequestError naming the bad part."""
        self.check_images(images)
        if not isinstance(text, str) or not text:
            raise InvalidRequestError(f"{field} must be a non-empty string (text holding the images' placeholders)",
                                      field)
        if len(text) > self.limits.max_prompt_chars:
            raise InvalidRequestError(f"{field} has {len(text)} characters, over the limit of "
                                      f"{self.limits.max_prompt_chars} (--max-prompt-chars)", field)
        placeholder = self.mm_processor.image_placeholder
        if field == "prompt" and text.count(placeholder) != len(images):  # a chat template writes them itself
            raise InvalidRequestError(f"prompt holds {text.count(placeholder)} image placeholders ({placeholder!r}) "
                                      f"for {len(images)} images: write one where each image goes", field)
        loaded = [self._load_image(item) for item in images]
        try:
            token_ids, features = self.mm_processor.process(text, loaded)
        except InvalidRequestError:
            raise
        except Exception as error:  # the image processor's own checks (e.g. an image too small to patch)
            raise InvalidRequestError(f"the model's processor refused the images: {error}", images[0].param) from None
        return MultiModalPrompt(token_ids, features)

    def check_images(self, images: list[ImageItem]) -> None:
        """That this model takes images, and no more of them than --limit-mm-per-prompt."""
        if not images:
            return
        if self.mm_processor is None:
            raise InvalidRequestError(f"model {self.info.model_name!r} does not take images: it is not a multimodal "
                                      "(vision-language) model", images[0].param)
        limit = self.multimodal.limits()["image"]
        if len(images) > limit:
            raise InvalidRequestError(f"the prompt has {len(images)} images, over the limit of {limit} per prompt "
                                      "(--limit-mm-per-prompt)", images[limit].param)

    def _load_image(self, item: ImageItem) -> Any:
        if item.url is not None:
            return self.media.load_image(item.url, item.param)
        self.media.check_pixels(item.image, item.param)
        return item.image

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, *,
                            continue_final_message: bool = False, chat_template: str | None = None,
                            chat_template_kwargs: dict[str, Any] | None = None,
                            documents: list[dict[str, str]] | None = None,
                            add_special_tokens: bool = False,
                            tools: list[dict[str, Any]] | None = None) -> list[int] | MultiModalPrompt:
        """A conversation -> prompt token ids, as vLLM renders it: the template (`chat_template`, else
        the tokenizer's or --chat-template's) renders to text, with `chat_template_kwargs` laid over
        add_generation_prompt, continue_final_message, documents and chat_template; the text is then
        encoded with `add_special_tokens` (False: the template writes BOS itself; transformers'
        tokenize=True gives the same ids). continue_final_message leaves the last message open (no
        end-of-turn) for the model to continue. `tools`: function tools for templates that render them;
        assistant tool_calls whose arguments are JSON text reach the template with them as a dict, as
        vLLM passes them (tool-use templates expect a mapping). Messages with image parts
        (engine/chat_content.py) reach the template with `{"type": "image"}` parts in their place,
        and give a MultiModalPrompt (`expand_images`; its text is encoded without special tokens).
        Raises InvalidRequestError naming the field."""
        if not messages:
            raise InvalidRequestError("messages is empty", "messages")
        if len(messages) >= self.info.max_model_len:  # each message takes at least a token of the template
            raise InvalidRequestError(f"messages has {len(messages)} messages; max_model_len "
                                      f"({self.info.max_model_len} tokens) cannot hold them", "messages")
        limit = self.limits.max_prompt_chars
        messages, images = split_images(messages)
        self.check_images(images)
        chars = sum(content_chars(m.get("content")) for m in messages)
        chars += sum(len(v) for document in documents or () for v in document.values())
        chars += len(json.dumps(tools, default=str)) if tools else 0  # (transformers also takes functions as tools)
        messages = [_tool_arguments_as_dicts(m) for m in messages]
        chars += sum(len(json.dumps(m["tool_calls"], default=str)) for m in messages if m.get("tool_calls"))
        if chars > limit:
            raise InvalidRequestError(f"messages have {chars} characters of content, over the limit of {limit} "
                                      "(--max-prompt-chars)", "messages")
        options: dict[str, Any] = {"chat_template": chat_template, "add_generation_prompt": add_generation_prompt,
                                   "continue_final_message": continue_final_message, "documents": documents,
                                   "tools": tools, **(chat_template_kwargs or {})}
        if "tokenize" in options:
            raise InvalidRequestError("Found unexpected chat template kwargs from request: {'tokenize'}",
                                      "chat_template_kwargs")
        if options["continue_final_message"] and options["add_generation_prompt"]:
            raise InvalidRequestError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                                      "continue_final_message")
        template, field = self._template(options.pop("chat_template"))
        try:
            text = self.tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, **options)
        except Exception as error:  # the template's own checks (e.g. roles must alternate) raise anything
            what = "the chat template refused the messages" if field == "messages" else "chat_template failed"
            raise InvalidRequestError(f"{what}: {error}", field) from None
        if len(text) > limit:
            raise InvalidRequestError(f"the chat template's text has {len(text)} characters, over the limit of "
                                      f"{limit} (--max-prompt-chars)", field)
        if images:
            return self.expand_images(text, images, "messages")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _template(self, chat_template: str | None) -> tuple[str, str]:
        """The template to render with (the request's, else the model's) and the field its errors name."""
        limit = self.limits.max_prompt_chars
        if chat_template is None:
            template = getattr(self.tokenizer, "chat_template", None)
            if not template:
                raise InvalidRequestError("this model has no chat template; send a plain prompt or a chat_template "
                                          "instead", "messages")
            return template, "messages"
        if not isinstance(chat_template, str):
            raise InvalidRequestError("chat_template must be a string (a Jinja template)", "chat_template")
        if len(chat_template) > limit:
            raise InvalidRequestError(f"chat_template has {len(chat_template)} characters, over the limit of {limit} "
                                      "(--max-prompt-chars)", "chat_template")
        return chat_template, "chat_template"

    def _structured_outputs(self, params: SamplingParams) -> SamplingParams:
        """The request's structured outputs with the server's defaults laid over them
        (--structured-outputs-config turns disable_any_whitespace and disable_additional_properties
        on for every request), and their grammar compiled once to check it: a bad schema, regex or
        grammar is refused here, naming the problem, before it reaches the engine."""
        wanted = params.structured_outputs
        if wanted is None:
            return params
        if self.disaggregation_mode != "null":
            raise InvalidRequestError("structured_outputs is not supported with prefill/decode disaggregation yet: "
                                      "send constrained requests to a monolithic server", "structured_outputs")
        defaults = self.structured_outputs
        if defaults.disable_any_whitespace or defaults.disable_additional_properties:
            wanted = dataclasses.replace(
                wanted, disable_any_whitespace=wanted.disable_any_whitespace or defaults.disable_any_whitespace,
                disable_additional_properties=wanted.disable_additional_properties
                or defaults.disable_additional_properties)
            params = dataclasses.replace(params, structured_outputs=wanted)
        grammar.validate(wanted)
        return params

    def _check_sizes(self, params: SamplingParams) -> None:
        limits = self.limits
        self._check_strings(params.stop, "stop", "strings", "a stop string")
        if len(params.stop_token_ids) > limits.max_stop_token_ids:
            raise InvalidRequestError(f"stop_token_ids has {len(params.stop_token_ids)} ids, over the limit of "
                                      f"{limits.max_stop_token_ids} (--max-stop-token-ids)", "stop_token_ids")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limits.max_logprobs:
                raise InvalidRequestError(f"{name} {value} is above the server's limit of {limits.max_logprobs} "
                                          "(--max-logprobs)", name)
        if params.logit_bias and len(params.logit_bias) > limits.max_logit_bias:
            raise InvalidRequestError(f"logit_bias has {len(params.logit_bias)} entries, over the limit of "
                                      f"{limits.max_logit_bias} (--max-logit-bias)", "logit_bias")
        # bad words are checked at every sampling step, like stop strings at every token: the same bounds
        self._check_strings(params.bad_words, "bad_words", "words", "a bad word")

    def _check_strings(self, strings: list[str], name: str, noun: str, one: str) -> None:
        """Count and length of a request's stop strings or bad words against --max-stop-sequences(-chars)."""
        limits = self.limits
        if len(strings) > limits.max_stop_sequences:
            raise InvalidRequestError(f"{name} has {len(strings)} {noun}, over the limit of "
                                      f"{limits.max_stop_sequences} (--max-stop-sequences)", name)
        longest = max((len(s) for s in strings), default=0)
        if longest > limits.max_stop_sequence_chars:
            raise InvalidRequestError(f"{one} has {longest} characters, over the limit of "
                                      f"{limits.max_stop_sequence_chars} (--max-stop-sequence-chars)", name)

    def _tokenize(self, prompt: Prompt, add_special_tokens: bool) -> tuple[str | None, list[int]]:
        if isinstance(prompt, MultiModalPrompt):  # the model's processor tokenized it
            return None, list(prompt.token_ids)
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", "prompt")
            if len(prompt) > self.limits.max_prompt_chars:
                raise InvalidRequestError(f"prompt has {len(prompt)} characters, over the limit of "
                                          f"{self.limits.max_prompt_chars} (--max-prompt-chars)", "prompt")
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            if not token_ids:  # e.g. control characters the tokenizer drops
                raise InvalidRequestError(f"prompt {prompt[:40]!r} encodes to no tokens", "prompt")
            return prompt, token_ids
        if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequestError("prompt must be a string or a list of token ids", "prompt")
        if not prompt:
            raise InvalidRequestError("prompt is empty", "prompt")
        vocab = self.info.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is out of range [0, {vocab})", "prompt")
        return None, list(prompt)

    def _truncate(self, token_ids: list[int], keep: int | None) -> list[int]:
        """truncate_prompt_tokens: the prompt's last `keep` tokens (-1: up to max_model_len)."""
        if keep is None:
            return token_ids
        limit = self.info.max_model_len
        if keep > limit:
            raise InvalidRequestError(f"truncate_prompt_tokens ({keep}) is greater than max_model_len ({limit}): "
                                      "select a smaller truncation size", "truncate_prompt_tokens")
        return token_ids[-(limit if keep == -1 else keep):]

    def _resolve_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        max_tokens = resolve_max_tokens(num_prompt_tokens, params.max_tokens, self.info.max_model_len)
        vocab = self.info.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be below the vocabulary size {vocab}", "stop_token_ids")
        if params.logit_bias and any(t >= vocab for t in params.logit_bias):
            raise InvalidRequestError(f"logit_bias keys must be token ids below the vocabulary size {vocab}",
                                      "logit_bias")
        if params.allowed_token_ids and any(t >= vocab for t in params.allowed_token_ids):
            raise InvalidRequestError(f"allowed_token_ids must be token ids below the vocabulary size {vocab}",
                                      "allowed_token_ids")
        bad_words_token_ids = tokenize_bad_words(self.tokenizer, params.bad_words) if params.bad_words else None
        if bad_words_token_ids and any(t >= vocab for word in bad_words_token_ids for t in word):
            raise InvalidRequestError(f"bad_words tokenize to token ids outside the model's vocabulary ({vocab})",
                                      "bad_words")
        extra_stops = [] if params.ignore_eos else [t for t in self.extra_stop_ids if t not in params.stop_token_ids]
        return dataclasses.replace(params, max_tokens=max_tokens, stop_token_ids=params.stop_token_ids + extra_stops,
                                   _bad_words_token_ids=bad_words_token_ids)


def _tool_arguments_as_dicts(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool_calls with each call's arguments as a dict (vLLM's rule: JSON
    text is decoded; what is not a JSON object becomes {}, so a bad turn in the history does not
    make the conversation unusable); other messages as they are."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not isinstance(calls, list):
        return message
    if not calls:  # no calls: the template's plain assistant path
        return {k: v for k, v in message.items() if k != "tool_calls"}
    converted = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise InvalidRequestError("each of an assistant message's tool_calls must be an object with a function",
                                      "messages")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments else {}
            except ValueError:
                arguments = {}
        converted.append({**call, "function": {**function, "arguments": arguments if isinstance(arguments, dict)
                                               else {}}})
    return {**message, "tool_calls": converted}


def tokenize_bad_words(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """Each bad word's token sequences, as vLLM makes them: the word without leading spaces, and
    with one leading space too where that is another sequence of the same length (the word
    inside text, for tokenizers that fold the space into the word's first token). Raises
    InvalidRequestError for a word that tokenizes to nothing."""
    token_ids: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            raise InvalidRequestError(f"bad_words entry {word!r} tokenizes to no token", "bad_words")
        token_ids.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            token_ids.append(spaced)
    return token_ids


def eos_ids(tokenizer: Any, source: ModelSource) -> tuple[int | None, list[int]]:
    """The tokenizer's EOS plus any other EOS ids of the model's generation config
    (Llama 3 instruct ends turns with a second one)."""
    eos = tokenizer.eos_token_id
    extra: list[int] = []
    path = os.path.join(source.path, "generation_config.json")
    if source.kind == "hf" and os.path.isfile(path):
        with open(path) as f:
            configured: Any = json.load(f).get("eos_token_id")
        ids = configured if isinstance(configured, list) else [configured] if configured is not None else []
        eos = eos if eos is not None else (ids[0] if ids else None)
        extra = [i for i in ids if i != eos]
    return eos, extra

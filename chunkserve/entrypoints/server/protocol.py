"""Request bodies of the HTTP API (OpenAI's and SGLang's field names) and their mapping to
SamplingParams. Pydantic checks them strictly where they enter, naming the body's own field
in its message: no coercion (`"4"` is not a number, `true` and `1.0` are not token ids), no
NaN or infinity, every number in its range. SamplingParams checks the values again for the
offline API, and the input processor checks sizes against the server's limits."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from chunkserve.core.disagg.protocol import MAX_ROOM, TransferParams
from chunkserve.errors import InvalidRequestError
from chunkserve.sampling_params import (
    LOGIT_BIAS_RANGE,
    MAX_LOGPROBS,
    REPETITION_PENALTY_RANGE,
    SEED_RANGE,
    BeamSearchParams,
    RequestOutputKind,
    SamplingParams,
)

logger = logging.getLogger(__name__)
TokenIds = list[int]
MAX_N = 64  # most samples of one prompt a request may ask for
Seed = Annotated[int, Field(ge=SEED_RANGE[0], lt=SEED_RANGE[1])]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Field(ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])]
Probability = Annotated[float, Field(ge=0.0, le=1.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=-1)]
Temperature = Annotated[float, Field(ge=0.0)]
MaxTokens = Annotated[int, Field(ge=1)]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
LogitBias = dict[Annotated[str, Field(pattern=r"^[0-9]{1,9}$")],
                 Annotated[float, Field(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1])]]


def _absent(value: Any) -> bool:
    return value in (None, False, [], {}, "")


# Fields of OpenAI's and vLLM's requests that chunkserve cannot honour (yet): a 400 naming them,
# unless the value asks for nothing (`tools: []`, `tool_choice: "none"`). vLLM answers 400 to
# `suffix` too.
_NO_TOOLS = "tool calling and structured outputs are not built yet"
REFUSED_FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "suffix": ("suffix is not currently supported (as in vLLM)", _absent),
    "tools": (_NO_TOOLS, _absent),
    "functions": (_NO_TOOLS, _absent),
    "tool_choice": (_NO_TOOLS, lambda v: _absent(v) or v == "none"),
    "function_call": (_NO_TOOLS, lambda v: _absent(v) or v == "none"),
    "response_format": (_NO_TOOLS, lambda v: _absent(v) or v == {"type": "text"}),
    "structured_outputs": (_NO_TOOLS, _absent),
    "guided_json": (_NO_TOOLS, _absent), "guided_regex": (_NO_TOOLS, _absent),
    "guided_choice": (_NO_TOOLS, _absent), "guided_grammar": (_NO_TOOLS, _absent),
    "json_schema": (_NO_TOOLS, _absent), "regex": (_NO_TOOLS, _absent), "ebnf": (_NO_TOOLS, _absent),
    "prompt_embeds": ("prompt embeddings are not supported: send text or token ids", _absent),
    "audio": ("audio output is not supported", _absent),
    "modalities": ("only text output is supported", lambda v: _absent(v) or v == ["text"]),
    "prediction": ("predicted outputs are not supported", _absent),
    "web_search_options": ("web search is not supported", _absent),
    "logits_processors": ("custom logits processors are not supported", _absent),
    "mm_processor_kwargs": ("multimodal inputs are not supported", _absent),
    "multi_modal_data": ("multimodal inputs are not supported", _absent),
    "lora_path": ("LoRA adapters are not supported", _absent),
}
# Fields vLLM accepts and does nothing with on its OpenAI server: accepted here too, unlogged.
ACCEPTED_FIELDS = frozenset({"user", "store", "metadata", "service_tier", "parallel_tool_calls", "reasoning_effort",
                             "spaces_between_special_tokens", "request_id"})
_logged_unknown: set[str] = set()


class _Body(BaseModel):
    # Unknown fields are kept aside, not dropped unseen: check_fields refuses the ones asking for
    # what chunkserve cannot do and logs the rest once per name (vLLM's behaviour).
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    def check_fields(self) -> None:
        for name, value in (self.model_extra or {}).items():
            refused = REFUSED_FIELDS.get(name)
            if refused is not None and not refused[1](value):
                raise InvalidRequestError(f"{name} is not supported: {refused[0]}", name)
            if name not in ACCEPTED_FIELDS and name not in _logged_unknown and refused is None:
                _logged_unknown.add(name)
                logger.warning("request field %r is not known to chunkserve and was ignored (logged once per name)",
                               name)


class StreamOptions(_Body):
    include_usage: bool = False


class _Bootstrap(_Body):
    """The router's pairing of a disaggregated request (SGLang's field names)."""

    bootstrap_host: Annotated[str, Field(pattern=r"^[A-Za-z0-9.\-]{1,253}$|^\[[0-9A-Fa-f:.]{2,45}\]$")] | None = None
    bootstrap_port: Annotated[int, Field(ge=1, le=65535)] | None = None
    bootstrap_room: Annotated[int, Field(ge=0, le=MAX_ROOM)] | None = None

    def transfer_params(self) -> TransferParams | None:
        given = [self.bootstrap_host, self.bootstrap_port, self.bootstrap_room]
        if all(value is None for value in given):
            return None
        if any(value is None for value in given):
            raise InvalidRequestError("bootstrap_host, bootstrap_port and bootstrap_room go together",
                                      "bootstrap_room")
        return TransferParams(self.bootstrap_room, self.bootstrap_host, self.bootstrap_port)


class _OpenAISampling(_Bootstrap):
    """The sampling fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: Probability | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    skip_special_tokens: bool = True
    priority: Annotated[int, Field(ge=-(2**63), lt=2**63)] = 0
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1  # samples per prompt (choices), sharing the prompt's KV blocks
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None  # requests share cached prefixes only within a salt
    logit_bias: LogitBias | None = None  # token id (as a string, OpenAI's JSON) -> bias
    # vLLM's extras
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    bad_words: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    prompt_logprobs: NumLogprobs | None = None
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens "token_id:N" (default: the server's flag)
    use_beam_search: bool = False  # vLLM's: n is the beam width; the answer comes whole (no stream)
    length_penalty: float = 1.0  # beam search ranks by cumulative logprob / length ** length_penalty

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """`defaults`: the model's generation config (--generation-config), for the fields the request leaves out."""
        if self.use_beam_search and self.stream:
            raise InvalidRequestError("use_beam_search does not stream here: send stream false (the beams are "
                                      "only known at the end)", "use_beam_search")
        given = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        defaults = dict(defaults or {})
        default_max_tokens = defaults.pop("max_tokens", None)
        given = {**defaults, **{name: value for name, value in given.items() if value is not None}}
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens, seed=self.seed, stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs, output_kind=output_kind(self.stream),
            logit_bias=None if self.logit_bias is None else {int(t): b for t, b in self.logit_bias.items()},
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words or [],
            include_stop_str_in_output=self.include_stop_str_in_output,
            truncate_prompt_tokens=self.truncate_prompt_tokens, prompt_logprobs=self.prompt_logprobs,
            **given,
        )

    def beam_search_params(self, params: SamplingParams) -> BeamSearchParams:
        """use_beam_search (vLLM's to_beam_search_params): n beams; of `params` (what
        sampling_params made of the body) only max_tokens, temperature, ignore_eos and
        include_stop_str_in_output count, as in vLLM."""
        return BeamSearchParams(beam_width=self.n, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                                temperature=params.temperature, length_penalty=self.length_penalty,
                                include_stop_str_in_output=params.include_stop_str_in_output)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: MaxTokens | None = 16
    logprobs: NumLogprobs | None = None
    echo: bool = False
    add_special_tokens: bool = True  # text prompts are encoded with BOS and the like (vLLM's field)

    def prompts(self) -> list[str | TokenIds]:
        """The prompt field as a list of prompts (a string, strings, token ids or lists of them)."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("prompt is empty", "prompt")
        return list(prompt)


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None

    def as_template_message(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class _ChatTemplateFields(_Body):
    """vLLM's fields that shape how the chat template renders a request's messages."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message is left open for the model to continue
    chat_template: str | None = None  # in place of the model's; needs --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None  # passed to the template, over the fields above
    documents: list[dict[str, str]] | None = None  # for templates that render RAG documents

    @property
    def has_request_template(self) -> bool:
        """Whether the request brings its own template (vLLM's test: the field, or a kwarg of that name)."""
        return self.chat_template is not None or (self.chat_template_kwargs or {}).get("chat_template") is not None

    def template_options(self, add_special_tokens: bool) -> dict[str, Any]:
        """The input processor's apply_chat_template arguments besides the messages."""
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, "chat_template": self.chat_template,
                "chat_template_kwargs": self.chat_template_kwargs, "documents": self.documents,
                "add_special_tokens": add_special_tokens}


class ChatCompletionRequest(_OpenAISampling, _ChatTemplateFields):
    messages: list[ChatMessage]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    add_special_tokens: bool = False  # BOS and the like on top of the template's own (vLLM's default: no)

    def chat_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(max_tokens, logprobs, defaults)


# SGLang's names in /generate's body for SamplingParams' fields (for the model's defaults and a refusal's message)
GENERATE_NAMES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "seed": "sampling_seed",
                  "include_stop_str_in_output": "no_stop_trim", "logprobs": "top_logprobs_num",
                  "prompt_logprobs": "logprob_start_len"}
# SGLang's /generate fields (of the body or its sampling_params) that ask for what chunkserve cannot do: a 400
# naming them unless the value asks for nothing. REFUSED_FIELDS applies too (lora_path, json_schema, regex, ebnf).
_NO_MULTIMODAL = "multimodal inputs are not supported"
GENERATE_REFUSED_FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "input_embeds": ("prompt embeddings are not supported: send text or input_ids", _absent),
    "image_data": (_NO_MULTIMODAL, _absent), "video_data": (_NO_MULTIMODAL, _absent),
    "audio_data": (_NO_MULTIMODAL, _absent),
    "lora_id": ("LoRA adapters are not supported", _absent),
    "custom_logit_processor": ("custom logit processors are not supported", _absent),
    "custom_params": ("custom logit processors are not supported", _absent),
    "return_hidden_states": ("hidden states are not returned", _absent),
    "return_routed_experts": ("routed experts are not returned", _absent),
    "token_ids_logprob": ("logprobs of chosen token ids are not supported: use top_logprobs_num", _absent),
    "session_params": ("sessions are not supported", _absent),
    "structural_tag": (_NO_TOOLS, _absent),
    "stop_regex": ("use stop strings", _absent),
}


class _GenerateBody(_Body):
    def check_fields(self) -> None:
        """SGLang's fields asking for what cannot be done are refused by name, then the common checks."""
        for name, value in (self.model_extra or {}).items():
            refused = GENERATE_REFUSED_FIELDS.get(name)
            if refused is not None and not refused[1](value):
                raise InvalidRequestError(f"{name} is not supported: {refused[0]}", name)
        super().check_fields()


class GenerateSamplingParams(_GenerateBody):
    """SGLang's `sampling_params` object. `spaces_between_special_tokens` is accepted and
    ignored (ACCEPTED_FIELDS), as vLLM's OpenAI server does."""

    max_new_tokens: MaxTokens = 128
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: Probability = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = False
    min_new_tokens: Annotated[int, Field(ge=0)] = 0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    skip_special_tokens: bool = True
    sampling_seed: Seed | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1  # samples per prompt, sharing the prompt's KV blocks
    no_stop_trim: bool = False  # keep the matched stop string (or stop token) in the output
    logit_bias: LogitBias | None = None  # token id (as a string) -> bias

    def to_sampling_params(self, stream: bool, defaults: dict[str, Any] | None = None, logprobs: int | None = None,
                           prompt_logprobs: int | None = None) -> SamplingParams:
        """`defaults`: the model's generation config, for the fields the request leaves out.
        `logprobs`, `prompt_logprobs`: what the body's return_logprob and its companions ask for."""
        unset = {name: value for name, value in (defaults or {}).items()
                 if GENERATE_NAMES.get(name, name) not in self.model_fields_set}
        return SamplingParams(**{
            "max_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty, **unset,
        }, stop=self.stop or [], stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
            min_tokens=self.min_new_tokens, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, skip_special_tokens=self.skip_special_tokens,
            seed=self.sampling_seed, output_kind=output_kind(stream), include_stop_str_in_output=self.no_stop_trim,
            logit_bias=None if self.logit_bias is None else {int(t): b for t, b in self.logit_bias.items()},
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        )


RequestId = Annotated[str, Field(min_length=1, max_length=256)]
LogprobStart = Annotated[int, Field(ge=-1)]


class GenerateRequest(_Bootstrap, _GenerateBody):
    """SGLang's native /generate body: one prompt (answered with one result object) or a batch
    (text or input_ids as a list: answered with a list), n samples of each. The logprob
    fields, rid and sampling_params take one value for every prompt or a list of one per prompt."""

    text: str | list[str] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    sampling_params: GenerateSamplingParams | list[GenerateSamplingParams] | None = None
    stream: bool = False
    rid: RequestId | list[RequestId] | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: LogprobStart | list[LogprobStart] | None = None  # -1: output tokens only (SGLang's default)
    top_logprobs_num: NumLogprobs | list[NumLogprobs] | None = None
    return_text_in_logprobs: bool = False

    def prompts(self) -> list[str | TokenIds]:
        """The prompts in order: one, or the batch's."""
        if (self.text is None) == (self.input_ids is None):
            raise InvalidRequestError("give exactly one of text and input_ids", "text")
        if self.text is not None:
            name, prompts = "text", [self.text] if isinstance(self.text, str) else list(self.text)
        else:
            ids = self.input_ids
            name, prompts = "input_ids", [ids] if not ids or isinstance(ids[0], int) else list(ids)
        if not prompts:
            raise InvalidRequestError(f"{name} is an empty list", name)
        return prompts

    @property
    def is_batch(self) -> bool:
        """Whether the prompt was given as a list (SGLang answers a list of results then, as for n > 1)."""
        return isinstance(self.text, list) or bool(self.input_ids and isinstance(self.input_ids[0], list))

    def per_prompt(self, name: str, count: int, default: Any) -> list[Any]:
        """A field given once for every prompt, or as a list of one value per prompt."""
        value = getattr(self, name)
        if value is None:
            return [default] * count
        if not isinstance(value, list):
            return [value] * count
        if len(value) != count:
            raise InvalidRequestError(f"{name} has {len(value)} values for {count} prompts", name)
        return value

    def request_ids(self, count: int, default: str) -> list[str]:
        """Each prompt's request id: rid (else `default`) for one prompt; for a batch, rid's
        list, or rid_0, rid_1, ... from one rid (SGLang's expansion)."""
        if isinstance(self.rid, list):
            return self.per_prompt("rid", count, None)
        base = default if self.rid is None else self.rid
        return [f"{base}_{i}" for i in range(count)] if self.is_batch else [base]


class TokenizeRequest(_ChatTemplateFields):
    """vLLM's /tokenize: a prompt, or messages through the chat template (with the chat fields)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # vLLM's defaults: true for a prompt, false for messages
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: TokenIds


class AbortRequest(_Body):
    """SGLang's /abort_request."""

    rid: str | None = None
    abort_all: bool = False


def output_kind(stream: bool) -> RequestOutputKind:
    """A stream sends what is new at each step; a plain response is built from the last output."""
    return RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY


def error_body(message: str, error_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


class ExportBody(_Body):
    """/export_request's optional body: blocks the destination caches, by their hash (hex)."""

    skip_block_hashes: Annotated[list[Annotated[str, Field(pattern="^[0-9a-f]{64}$")]], Field(max_length=1 << 16)] = []

"""Request bodies of the HTTP API (OpenAI's and SGLang's field names) and their mapping to
SamplingParams. Pydantic checks them strictly where they enter, naming the body's own field
in its message: no coercion (`"4"` is not a number, `true` and `1.0` are not token ids), no
NaN or infinity, every number in its range. SamplingParams checks the values again for the
offline API, and the input processor checks sizes against the server's limits."""

from __future__ import annotations

import json
import logging
import re
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
    StructuredOutputsParams,
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
_CHAT_TOOLS = "tool calling is served on /v1/chat/completions"
_FUNCTIONS = "OpenAI's deprecated functions and function_call fields are not supported: send tools and tool_choice"
_REMOVED = "vLLM removed the guided_* fields in v0.12.0: send structured_outputs"
REFUSED_FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "suffix": ("suffix is not currently supported (as in vLLM)", _absent),
    "tools": (_CHAT_TOOLS, _absent),
    "functions": (_FUNCTIONS, _absent),
    "tool_choice": (_CHAT_TOOLS, lambda v: _absent(v) or v == "none"),
    "function_call": (_FUNCTIONS, lambda v: _absent(v) or v == "none"),
    # refused rather than ignored (as vLLM now does), so that an old client's constraint is not silently dropped
    "guided_json": (f'{_REMOVED} {{"json": SCHEMA}} instead', _absent),
    "guided_regex": (f'{_REMOVED} {{"regex": PATTERN}} instead', _absent),
    "guided_choice": (f'{_REMOVED} {{"choice": [...]}} instead', _absent),
    "guided_grammar": (f'{_REMOVED} {{"grammar": GRAMMAR}} instead', _absent),
    "guided_whitespace_pattern": (f'{_REMOVED} {{..., "disable_any_whitespace": true}} for compact JSON', _absent),
    "guided_decoding_backend": (f"{_REMOVED} and leave the backend out (llguidance here: --structured-outputs-config)",
                                _absent),
    "structural_tag": (f'{_REMOVED} {{"structural_tag": TEXT}} or response_format {{"type": "structural_tag", ...}}',
                       _absent),
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


# ----- structured outputs: every request form -> StructuredOutputsParams ---------------------------

class JsonSchemaFormat(_Body):
    """OpenAI's response_format.json_schema."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # (`schema` is a BaseModel attribute)
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's response_format, and vLLM's structural_tag form of it (its other keys,
    `structures` and `triggers`, are kept as the tag's JSON)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None

    def params(self) -> StructuredOutputsParams | None:
        """None for text. OpenAI's strict mode requires every object of the schema to close its
        properties (additionalProperties false), so strict closes those that leave it unsaid
        (vLLM ignores strict and leaves them open)."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "structural_tag":
            return StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag",
                                                                      **(self.model_extra or {})}))
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise InvalidRequestError('response_format of type json_schema needs json_schema: {"name": ..., '
                                      '"schema": {...}}', "response_format")
        return StructuredOutputsParams(json=self.json_schema.schema_,
                                       disable_additional_properties=bool(self.json_schema.strict))


class StructuredOutputsBody(BaseModel):
    """vLLM's `structured_outputs` request field: its StructuredOutputsParams' fields. An
    unknown key is refused by name (it would otherwise be a constraint silently dropped)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    json_: dict[str, Any] | str | None = Field(None, alias="json")  # (`json` is a BaseModel attribute)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def params(self) -> StructuredOutputsParams:
        if self.whitespace_pattern is not None:
            raise InvalidRequestError("structured_outputs.whitespace_pattern is not supported: disable_any_whitespace "
                                      "true gives compact JSON", "structured_outputs")
        return StructuredOutputsParams(
            json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar, json_object=self.json_object,
            structural_tag=self.structural_tag, disable_any_whitespace=self.disable_any_whitespace,
            disable_additional_properties=self.disable_additional_properties)


# SGLang's fields (of /generate's sampling_params, and of its OpenAI bodies) -> StructuredOutputsParams' kinds
SGLANG_STRUCTURED_FIELDS = {"json_schema": "json", "regex": "regex", "ebnf": "grammar",
                            "structural_tag": "structural_tag"}
SGLANG_ANY_JSON = "$$ANY$$"  # SGLang's json_schema for any JSON value (the empty schema)


def _sglang_params(body: BaseModel, name: str) -> StructuredOutputsParams:
    """The structured outputs of SGLang's field `name` of `body`."""
    value = getattr(body, name)
    if name == "json_schema" and value == SGLANG_ANY_JSON:
        value = "{}"
    return StructuredOutputsParams(**{SGLANG_STRUCTURED_FIELDS[name]: value})


def structured_outputs_form(body: BaseModel, forms: tuple[str, ...]) -> str | None:
    """Which of the fields `forms` asks `body` for structured outputs (response_format text asks
    for nothing): at most one, else a 400 naming the second."""
    given = [name for name in forms if getattr(body, name) is not None
             and not (name == "response_format" and body.response_format.type == "text")]
    if len(given) > 1:
        raise InvalidRequestError(f"{given[0]} and {given[1]} both ask for structured outputs: give one of "
                                  f"{', '.join(forms)}", given[1])
    return given[0] if given else None


def structured_outputs_params(body: BaseModel, forms: tuple[str, ...]) -> StructuredOutputsParams | None:
    """What `body` asks for with whichever of the fields `forms` it uses (None: nothing); an
    error names the body's field."""
    form = structured_outputs_form(body, forms)
    try:
        if form is None:
            return None
        if form in ("response_format", "structured_outputs"):
            return getattr(body, form).params()
        return _sglang_params(body, form)
    except InvalidRequestError as error:
        raise rename_error(error, structured_outputs_names(form)) from None


def structured_outputs_names(form: str | None) -> dict[str, str]:
    """How a body that asked with the field `form` names structured outputs' errors, which the
    input processor and StructuredOutputsParams raise as `structured_outputs` (param) and
    `structured_outputs.<kind>` (in the message): for the field_names of Serving._add_all."""
    if form in (None, "structured_outputs"):
        return {}
    if form == "response_format":
        return {"structured_outputs": form, "structured_outputs.json": "response_format.json_schema.schema"}
    return {"structured_outputs": form, **{f"structured_outputs.{kind}": name
                                           for name, kind in SGLANG_STRUCTURED_FIELDS.items()}}


def rename_error(error: InvalidRequestError, names: dict[str, str]) -> InvalidRequestError:
    """`error` with its field named as the body names it: `names` maps SamplingParams' names to
    the body's (dotted ones, such as structured_outputs.json, rename that part of the message
    first). The error itself where the body uses the same name."""
    name = names.get(error.param)
    if name is None:
        return error
    message = str(error)
    for old in sorted((key for key in names if key == error.param or key.startswith(f"{error.param}.")),
                      key=len, reverse=True):
        message = re.sub(rf"(?<![\w.]){re.escape(old)}(?!\w)", names[old], message)
    return InvalidRequestError(message, name)


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


OPENAI_STRUCTURED_FORMS = ("response_format", "structured_outputs", "json_schema", "regex", "ebnf")


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
    # structured outputs, in OpenAI's, vLLM's or SGLang's form (one per request)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    json_schema: str | None = None  # SGLang's: a JSON schema's text
    regex: str | None = None  # SGLang's
    ebnf: str | None = None  # SGLang's: a grammar

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """`defaults`: the model's generation config (--generation-config), for the fields the request leaves out."""
        if self.use_beam_search and self.stream:
            raise InvalidRequestError("use_beam_search does not stream here: send stream false (the beams are "
                                      "only known at the end)", "use_beam_search")
        structured_outputs = structured_outputs_params(self, OPENAI_STRUCTURED_FORMS)
        if self.use_beam_search and structured_outputs is not None:
            raise InvalidRequestError("use_beam_search cannot be combined with structured outputs: its beams are not "
                                      "constrained", "use_beam_search")
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
            structured_outputs=structured_outputs, **given,
        )

    def structured_outputs_names(self) -> dict[str, str]:
        """The body's names for structured outputs' errors (Serving._add_all's field_names)."""
        return structured_outputs_names(structured_outputs_form(self, OPENAI_STRUCTURED_FORMS))

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
    max_tokens: Annotated[int, Field(ge=0)] | None = 16  # 0 only with echo (echo_only)
    logprobs: NumLogprobs | None = None
    echo: bool = False
    add_special_tokens: bool = True  # text prompts are encoded with BOS and the like (vLLM's field)

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) back, nothing generated, as vLLM
        answers it (scoring a text); the engine samples one token, which the answer leaves out."""
        return self.echo and self.max_tokens == 0

    def check_fields(self) -> None:
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError("max_tokens must be at least 1 (0 only with echo: the prompt alone)",
                                      "max_tokens")
        super().check_fields()

    def completion_max_tokens(self) -> int | None:
        """The engine's max_tokens: one for an echo-only request (the sample it leaves out)."""
        return 1 if self.echo_only else self.max_tokens

    def prompts(self) -> list[str | TokenIds]:
        """The prompt field as a list of prompts (a string, strings, token ids or lists of them)."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
            return [prompt]
        if not prompt:
            raise InvalidRequestError("prompt is empty", "prompt")
        return list(prompt)


class FunctionDefinition(_Body):
    """A function tool (OpenAI's): `parameters` is its arguments' JSON schema."""

    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatCompletionTool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Body):
    name: Annotated[str, Field(min_length=1)]


class NamedToolChoice(_Body):
    """tool_choice naming the function to call."""

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] = ""  # JSON text (OpenAI's), or the object itself


class MessageToolCall(_Body):
    """A call of an assistant message in the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls (its content may then be null)
    tool_call_id: str | None = None  # a tool message: the call it answers

    def as_template_message(self) -> dict[str, Any]:
        """The message as chat templates take it: content a string (null: empty), and the tool
        fields only where given (the input processor turns calls' arguments into dicts)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls is not None:
            message["tool_calls"] = [call.model_dump(exclude_none=True) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class _ChatTemplateFields(_Body):
    """vLLM's fields that shape how the chat template renders a request's messages."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message is left open for the model to continue
    chat_template: str | None = None  # in place of the model's; needs --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None  # passed to the template, over the fields above
    documents: list[dict[str, str]] | None = None  # for templates that render RAG documents
    tools: list[ChatCompletionTool] | None = None  # for templates that render function tools

    @property
    def has_request_template(self) -> bool:
        """Whether the request brings its own template (vLLM's test: the field, or a kwarg of that name)."""
        return self.chat_template is not None or (self.chat_template_kwargs or {}).get("chat_template") is not None

    def template_options(self, add_special_tokens: bool) -> dict[str, Any]:
        """The input processor's apply_chat_template arguments besides the messages."""
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, "chat_template": self.chat_template,
                "chat_template_kwargs": self.chat_template_kwargs, "documents": self.documents,
                "add_special_tokens": add_special_tokens,
                "tools": [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None}


class ChatCompletionRequest(_OpenAISampling, _ChatTemplateFields):
    messages: list[ChatMessage]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    add_special_tokens: bool = False  # BOS and the like on top of the template's own (vLLM's default: no)
    tool_choice: ToolChoice | None = None  # default: "auto" with tools, else "none" (vLLM's)
    parallel_tool_calls: bool | None = None  # false: only the first call is kept

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
# naming them unless the value asks for nothing. REFUSED_FIELDS applies too (lora_path).
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
    "stop_regex": ("use stop strings", _absent),
    # structured outputs belong in sampling_params (SGLang's place): at the top they would be dropped unseen
    **{name: ("it goes in sampling_params", _absent) for name in ("json_schema", "regex", "ebnf", "structural_tag")},
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
    # structured outputs (one of them): a JSON schema's text ("$$ANY$$": any JSON), a regex, a grammar
    # (GBNF/EBNF, or Lark), vLLM's structural tag JSON
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

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
            structured_outputs=structured_outputs_params(self, tuple(SGLANG_STRUCTURED_FIELDS)),
        )

    def structured_outputs_names(self) -> dict[str, str]:
        """The body's names for structured outputs' errors (Serving._add_all's field_names)."""
        return structured_outputs_names(structured_outputs_form(self, tuple(SGLANG_STRUCTURED_FIELDS)))


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

"""What every API dialect's request bodies share (openai_protocol.py, sglang_protocol.py,
vllm_protocol.py): the strict base model, the field types and their ranges, the fields refused
or accepted unread, structured outputs in each dialect's form, disaggregation's bootstrap
fields, and OpenAI's error shape.

Pydantic checks bodies strictly where they enter, naming the body's own field in its message:
no coercion (`"4"` is not a number, `true` and `1.0` are not token ids), no NaN or infinity,
every number in its range. SamplingParams checks the values again for the offline API, and
the input processor checks sizes against the server's limits."""

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
    RequestOutputKind,
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


def absent(value: Any) -> bool:
    return value in (None, False, [], {}, "")


# Fields of OpenAI's and vLLM's requests that chunkserve cannot honour (yet): a 400 naming them,
# unless the value asks for nothing (`tools: []`, `tool_choice: "none"`). vLLM answers 400 to
# `suffix` too.
_CHAT_TOOLS = "tool calling is served on /v1/chat/completions"
_FUNCTIONS = "OpenAI's deprecated functions and function_call fields are not supported: send tools and tool_choice"
_REMOVED = "vLLM removed the guided_* fields in v0.12.0: send structured_outputs"
REFUSED_FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "suffix": ("suffix is not currently supported (as in vLLM)", absent),
    "tools": (_CHAT_TOOLS, absent),
    "functions": (_FUNCTIONS, absent),
    "tool_choice": (_CHAT_TOOLS, lambda v: absent(v) or v == "none"),
    "function_call": (_FUNCTIONS, lambda v: absent(v) or v == "none"),
    # refused rather than ignored (as vLLM now does), so that an old client's constraint is not silently dropped
    "guided_json": (f'{_REMOVED} {{"json": SCHEMA}} instead', absent),
    "guided_regex": (f'{_REMOVED} {{"regex": PATTERN}} instead', absent),
    "guided_choice": (f'{_REMOVED} {{"choice": [...]}} instead', absent),
    "guided_grammar": (f'{_REMOVED} {{"grammar": GRAMMAR}} instead', absent),
    "guided_whitespace_pattern": (f'{_REMOVED} {{..., "disable_any_whitespace": true}} for compact JSON', absent),
    "guided_decoding_backend": (f"{_REMOVED} and leave the backend out (llguidance here: --structured-outputs-config)",
                                absent),
    "structural_tag": (f'{_REMOVED} {{"structural_tag": TEXT}} or response_format {{"type": "structural_tag", ...}}',
                       absent),
    "prompt_embeds": ("prompt embeddings are not supported: send text or token ids", absent),
    "audio": ("audio output is not supported", absent),
    "modalities": ("only text output is supported", lambda v: absent(v) or v == ["text"]),
    "prediction": ("predicted outputs are not supported", absent),
    "web_search_options": ("web search is not supported", absent),
    "logits_processors": ("custom logits processors are not supported", absent),
    "mm_processor_kwargs": ("the model's processor runs with the model folder's settings", absent),
    "multi_modal_data": ("send images as image_url content parts of /v1/chat/completions messages", absent),
    "lora_path": ("LoRA adapters are not supported", absent),
}
# Fields vLLM accepts and does nothing with on its OpenAI server: accepted here too, unlogged.
ACCEPTED_FIELDS = frozenset({"user", "store", "metadata", "service_tier", "parallel_tool_calls", "reasoning_effort",
                             "spaces_between_special_tokens", "request_id"})
_logged_unknown: set[str] = set()


class Body(BaseModel):
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


# ----- structured outputs: every request form -> StructuredOutputsParams ---------------------------

class JsonSchemaFormat(Body):
    """OpenAI's response_format.json_schema."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # (`schema` is a BaseModel attribute)
    strict: bool | None = None


class ResponseFormat(Body):
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


class BootstrapFields(Body):
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


def output_kind(stream: bool) -> RequestOutputKind:
    """A stream sends what is new at each step; a plain response is built from the last output."""
    return RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY


def error_body(message: str, error_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}

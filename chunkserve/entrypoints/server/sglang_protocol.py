"""SGLang's request bodies: /generate (its sampling_params, batches, logprob fields),
/abort_request, and /export_request's optional body."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import Field

from chunkserve.entrypoints.server.protocol import (
    MAX_N,
    SGLANG_STRUCTURED_FIELDS,
    Body,
    BootstrapFields,
    LogitBias,
    MaxTokens,
    NumLogprobs,
    Penalty,
    Probability,
    RepetitionPenalty,
    Seed,
    Temperature,
    TokenIds,
    TopK,
    TopP,
    absent,
    output_kind,
    structured_outputs_form,
    structured_outputs_names,
    structured_outputs_params,
)
from chunkserve.errors import InvalidRequestError
from chunkserve.sampling_params import SamplingParams

# SGLang's names in /generate's body for SamplingParams' fields (for the model's defaults and a refusal's message)
GENERATE_NAMES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens", "seed": "sampling_seed",
                  "include_stop_str_in_output": "no_stop_trim", "logprobs": "top_logprobs_num",
                  "prompt_logprobs": "logprob_start_len"}
# SGLang's /generate fields (of the body or its sampling_params) that ask for what chunkserve cannot do: a 400
# naming them unless the value asks for nothing. protocol.REFUSED_FIELDS applies too (lora_path).
_NO_MULTIMODAL = "multimodal inputs are not supported on /generate"
_IMAGES_BY_CHAT = "images are not taken on /generate: send them as image_url content parts to /v1/chat/completions"
GENERATE_REFUSED_FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "input_embeds": ("prompt embeddings are not supported: send text or input_ids", absent),
    "image_data": (_IMAGES_BY_CHAT, absent), "video_data": (_NO_MULTIMODAL, absent),
    "audio_data": (_NO_MULTIMODAL, absent),
    "lora_id": ("LoRA adapters are not supported", absent),
    "custom_logit_processor": ("custom logit processors are not supported", absent),
    "custom_params": ("custom logit processors are not supported", absent),
    "return_hidden_states": ("hidden states are not returned", absent),
    "return_routed_experts": ("routed experts are not returned", absent),
    "token_ids_logprob": ("logprobs of chosen token ids are not supported: use top_logprobs_num", absent),
    "session_params": ("sessions are not supported", absent),
    "stop_regex": ("use stop strings", absent),
    # structured outputs belong in sampling_params (SGLang's place): at the top they would be dropped unseen
    **{name: ("it goes in sampling_params", absent) for name in ("json_schema", "regex", "ebnf", "structural_tag")},
}


class _GenerateBody(Body):
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


class GenerateRequest(BootstrapFields, _GenerateBody):
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


class AbortRequest(Body):
    """SGLang's /abort_request."""

    rid: str | None = None
    abort_all: bool = False


class ExportBody(Body):
    """/export_request's optional body: blocks the destination caches, by their hash (hex)."""

    skip_block_hashes: Annotated[list[Annotated[str, Field(pattern="^[0-9a-f]{64}$")]], Field(max_length=1 << 16)] = []

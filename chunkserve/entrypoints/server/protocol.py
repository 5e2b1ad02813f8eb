"""Request bodies of the HTTP API (OpenAI's and SGLang's field names) and their mapping to
SamplingParams. Pydantic checks them strictly where they enter, naming the body's own field
in its message: no coercion (`"4"` is not a number, `true` and `1.0` are not token ids), no
NaN or infinity, every number in its range. SamplingParams checks the values again for the
offline API, and the input processor checks sizes against the server's limits."""

from __future__ import annotations

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
    SamplingParams,
)

TokenIds = list[int]
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


class _Body(BaseModel):
    # Unknown fields are ignored, as OpenAI-compatible servers do: clients send extras.
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


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
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None  # requests share cached prefixes only within a salt
    logit_bias: LogitBias | None = None  # token id (as a string, OpenAI's JSON) -> bias

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        if self.n != 1:
            raise InvalidRequestError(f"n must be 1 (several choices per prompt are not supported), got {self.n}", "n")
        given = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        return SamplingParams(
            max_tokens=max_tokens, seed=self.seed, stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, skip_special_tokens=self.skip_special_tokens,
            logprobs=logprobs, output_kind=output_kind(self.stream),
            logit_bias=None if self.logit_bias is None else {int(t): b for t, b in self.logit_bias.items()},
            **{name: value for name, value in given.items() if value is not None},
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: MaxTokens | None = 16
    logprobs: NumLogprobs | None = None
    echo: bool = False

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


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    add_generation_prompt: bool = True

    def chat_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(max_tokens, logprobs)


class GenerateSamplingParams(_Body):
    """SGLang's `sampling_params` object."""

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

    def to_sampling_params(self, stream: bool) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos, min_tokens=self.min_new_tokens, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            skip_special_tokens=self.skip_special_tokens, seed=self.sampling_seed, output_kind=output_kind(stream),
        )


class GenerateRequest(_Bootstrap):
    """SGLang's native /generate body (one prompt per request)."""

    text: str | None = None
    input_ids: TokenIds | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool = False
    rid: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None

    def prompt(self) -> str | TokenIds:
        if (self.text is None) == (self.input_ids is None):
            raise InvalidRequestError("give exactly one of text and input_ids", "text")
        return self.text if self.text is not None else self.input_ids


def output_kind(stream: bool) -> RequestOutputKind:
    """A stream sends what is new at each step; a plain response is built from the last output."""
    return RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY


def error_body(message: str, error_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


class ExportBody(_Body):
    """/export_request's optional body: blocks the destination caches, by their hash (hex)."""

    skip_block_hashes: Annotated[list[Annotated[str, Field(pattern="^[0-9a-f]{64}$")]], Field(max_length=1 << 16)] = []

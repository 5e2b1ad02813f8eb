"""OpenAI's request bodies (/v1/completions, /v1/chat/completions, their tools and messages),
with vLLM's and SGLang's extra fields, and their mapping to SamplingParams."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from chunkserve.entrypoints.server.protocol import (
    MAX_N,
    Body,
    BootstrapFields,
    LogitBias,
    MaxTokens,
    NumLogprobs,
    Penalty,
    Probability,
    RepetitionPenalty,
    ResponseFormat,
    Seed,
    StructuredOutputsBody,
    Temperature,
    TokenIds,
    TopK,
    TopP,
    output_kind,
    structured_outputs_form,
    structured_outputs_names,
    structured_outputs_params,
)
from chunkserve.errors import InvalidRequestError
from chunkserve.sampling_params import BeamSearchParams, SamplingParams


class StreamOptions(Body):
    include_usage: bool = False


OPENAI_STRUCTURED_FORMS = ("response_format", "structured_outputs", "json_schema", "regex", "ebnf")


class _OpenAISampling(BootstrapFields):
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
            max_tokens=default_max_tokens if max_tokens is None else max_tokens, seed=self.seed, stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [],
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


class FunctionDefinition(Body):
    """A function tool (OpenAI's): `parameters` is its arguments' JSON schema."""

    name: Annotated[str, Field(min_length=1)]
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatCompletionTool(Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(Body):
    name: Annotated[str, Field(min_length=1)]


class NamedToolChoice(Body):
    """tool_choice naming the function to call."""

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(Body):
    name: str
    arguments: str | dict[str, Any] = ""  # JSON text (OpenAI's), or the object itself


class MessageToolCall(Body):
    """A call of an assistant message in the history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(Body):
    type: Literal["text"]
    text: str


class ImageURL(Body):
    url: str  # data:image/...;base64, file:// (under --allowed-local-media-path) or http(s) (--allowed-media-domains)
    detail: Literal["auto", "low", "high"] | None = None  # OpenAI's; the model's processor decides the resolution


class ImageURLPart(Body):
    type: Literal["image_url"]
    image_url: ImageURL | str  # vLLM also takes the URL itself


ContentPart = Annotated[TextPart | ImageURLPart, Field(discriminator="type")]


class ChatMessage(Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls (its content may then be null)
    tool_call_id: str | None = None  # a tool message: the call it answers

    def as_template_message(self) -> dict[str, Any]:
        """The message as chat templates take it: content a string (null: empty; text parts
        joined), or, where it has images, its parts in order (the input processor takes the
        images out), and the tool fields only where given (the input processor turns calls'
        arguments into dicts)."""
        content: Any = self.content
        if isinstance(content, list) and any(isinstance(part, ImageURLPart) for part in content):
            content = [part.model_dump(exclude_none=True) for part in content]
        elif isinstance(content, list):
            content = "".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls is not None:
            message["tool_calls"] = [call.model_dump(exclude_none=True) for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatTemplateFields(Body):
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


class ChatCompletionRequest(_OpenAISampling, ChatTemplateFields):
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

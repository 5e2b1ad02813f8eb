"""Per-request sampling and stopping parameters (the vLLM / OpenAI field names)."""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import NoReturn

from chunkserve.errors import InvalidRequestError

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 1024  # the hard bound; a server allows --max-logprobs (default 20)
# Outside this range the penalty overflows float32 logits (a logit of 50 / 1e-45 is inf), and
# one request's inf would make its row of probabilities NaN.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes


class RequestOutputKind(enum.Enum):
    """What each `RequestOutput` of a request carries (vLLM's names)."""

    CUMULATIVE = "cumulative"  # everything so far: text, token ids, logprobs (the offline default)
    DELTA = "delta"  # only what is new since the last output: a stream's events
    FINAL_ONLY = "final_only"  # one output, when the request finishes: a non-streamed response


@dataclass
class StructuredOutputsParams:
    """What the output must match (vLLM's StructuredOutputsParams): exactly one of `json` (a JSON
    schema, as a dict or its text), `regex`, `choice` (one of these strings), `grammar` (Lark, or
    GBNF/EBNF when its rules are written `::=`), `json_object` (any JSON object) or
    `structural_tag` (vLLM's JSON: free text in which each `begin` ... `end` segment, once a
    trigger appears, follows its schema). Decoding is constrained token by token, so the output
    parses unless it is cut short by max_tokens or a stop string.

    `disable_any_whitespace`: JSON without whitespace between tokens (compact output);
    `disable_additional_properties`: a schema's objects take only the properties it names."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self) -> None:
        given = [kind for kind in self.KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError("structured_outputs takes exactly one of json, regex, choice, grammar, "
                                      f"json_object and structural_tag; got {given or 'none'}", "structured_outputs")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise InvalidRequestError("structured_outputs.choice must be a non-empty list of strings",
                                      "structured_outputs")
        for kind in ("regex", "grammar", "structural_tag"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"structured_outputs.{kind} must be a non-empty string",
                                          "structured_outputs")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidRequestError("structured_outputs.json must be a JSON schema (an object or its JSON text)",
                                      "structured_outputs")

    @property
    def kind(self) -> str:
        """Which of the constraint fields is set."""
        return next(kind for kind in self.KINDS if getattr(self, kind) not in (None, False))


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    `temperature == 0` means greedy. `max_tokens=None` means "up to the model's length
    limit". Stop strings are matched on the detokenized text and are left out of it unless
    `include_stop_str_in_output`.
    """

    # samples of the prompt (LLM.generate answers them as one RequestOutput's outputs; the engine takes one per
    # request): they share its KV blocks through the prefix cache; with a seed, sample i uses seed + i (vLLM's)
    n: int = 1
    best_of: int | None = None  # vLLM V1 dropped it: only None or n is accepted
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob and the top k
    logit_bias: dict[int, float] | None = None  # added to the token's logit before sampling (OpenAI's)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    # Words not to generate (vLLM's rule): the last token of each word's tokenization is banned whenever the
    # output so far ends with the tokens before it, so a one-token word is always banned.
    bad_words: list[str] = field(default_factory=list)
    prompt_logprobs: int | None = None  # k: each prompt token's logprob (after the first) and the top k
    truncate_prompt_tokens: int | None = None  # k: keep only the prompt's last k tokens; -1: max_model_len
    structured_outputs: StructuredOutputsParams | None = None  # constrained decoding (JSON schema, regex, ...)
    # bad_words tokenized by the input processor, with and without a leading space (vLLM's private field)
    _bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        """Raises InvalidRequestError for the first field out of its type or range, named as `param`."""
        self._check_number_types()
        self._check_lengths()
        self._check_sampling_ranges()
        self._check_stopping()
        self._check_logprobs_and_bias()
        self._check_token_options()

    def _check_number_types(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                _fail(f"{name} must be a finite number, got {value!r}")
        for name in ("top_k", "min_tokens"):
            if not _is_int(getattr(self, name)):
                _fail(f"{name} must be an integer, got {getattr(self, name)!r}")

    def _check_lengths(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            _fail(f"n must be at least 1, got {self.n!r}")
        if self.best_of is not None and self.best_of != self.n:
            _fail(f"best_of must be None or equal to n ({self.n}), got {self.best_of!r}: vLLM V1 removed best_of; "
                  "ask for n samples with logprobs and pick by cumulative_logprob instead")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            _fail(f"max_tokens must be at least 1, got {self.max_tokens!r}")

    def _check_sampling_ranges(self) -> None:
        if self.temperature < 0:
            _fail(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            _fail(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            _fail(f"top_k must be 0 or -1 (disabled) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            _fail(f"min_p must be in [0, 1], got {self.min_p}")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            _fail(f"repetition_penalty must be in [{low}, {high}], got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            _fail(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            _fail(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")

    def _check_stopping(self) -> None:
        if self.min_tokens < 0:
            _fail(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            _fail("stop must be a list of non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            _fail("stop_token_ids must be non-negative integers")

    def _check_logprobs_and_bias(self) -> None:
        if self.seed is not None and (not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            _fail(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            _fail(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.logit_bias is not None:
            low, high = LOGIT_BIAS_RANGE
            if not isinstance(self.logit_bias, dict) or not all(
                    _is_int(t) and t >= 0 and _is_number(b) and low <= b <= high for t, b in self.logit_bias.items()):
                _fail(f"logit_bias must map token ids to biases in [{low:g}, {high:g}]")

    def _check_token_options(self) -> None:
        if not isinstance(self.output_kind, RequestOutputKind):
            _fail(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            _fail(f"include_stop_str_in_output must be a boolean, got {self.include_stop_str_in_output!r}")
        if self.allowed_token_ids is not None and not _is_token_list(self.allowed_token_ids):
            _fail("allowed_token_ids must be a non-empty list of token ids")
        if any(not isinstance(w, str) or not w for w in self.bad_words):
            _fail("bad_words must be a list of non-empty strings")
        if self._bad_words_token_ids is not None and not (
                isinstance(self._bad_words_token_ids, list) and all(map(_is_token_list, self._bad_words_token_ids))):
            _fail("bad_words token ids must be a list of non-empty lists of token ids")
        if self.prompt_logprobs is not None and (
                not _is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            _fail(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if self.truncate_prompt_tokens is not None and (
                not _is_int(self.truncate_prompt_tokens) or self.truncate_prompt_tokens < -1
                or self.truncate_prompt_tokens == 0):
            _fail(f"truncate_prompt_tokens must be an integer >= 1 or -1, got {self.truncate_prompt_tokens!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            _fail(f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}")

    def samples(self) -> list[SamplingParams]:
        """One SamplingParams (n = 1) per sample, sample i seeded with seed + i (vLLM's rule), so
        seeded samples differ and each is reproducible."""
        return [dataclasses.replace(self, n=1, best_of=None, seed=None if self.seed is None else self.seed + i)
                for i in range(self.n)]

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """The tokenized bad words (None until the input processor has tokenized them)."""
        return self._bad_words_token_ids

    @property
    def adjusts_logits(self) -> bool:
        """A logit bias or a penalty changes this request's logits before sampling."""
        return (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
        )


@dataclass
class BeamSearchParams:
    """vLLM's parameters of `LLM.beam_search` (and of the server's `use_beam_search`, with n as the
    width): keep the `beam_width` most likely sequences at each of up to `max_tokens` steps
    (None: up to max_model_len). `length_penalty` divides a sequence's cumulative logprob by its
    length ** length_penalty when beams are ranked; `temperature` is that of each step's sample,
    which joins the top 2 * beam_width tokens as a candidate (vLLM's rule)."""

    beam_width: int
    max_tokens: int | None
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        def fail(message: str) -> None:
            raise InvalidRequestError(message, param=message.split(" ", 1)[0])

        if not _is_int(self.beam_width) or self.beam_width < 1:
            fail(f"beam_width must be at least 1, got {self.beam_width!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            fail(f"max_tokens must be at least 1, got {self.max_tokens!r}")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                fail(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            fail(f"temperature must be non-negative, got {self.temperature}")

    def step_params(self) -> SamplingParams:
        """Each beam's request at each step: one token with 2 * beam_width logprobs (the
        candidates, as vLLM and transformers take them). EOS is ignored by the request, so the
        step's record always comes back; the search decides what EOS ends."""
        return SamplingParams(max_tokens=1, temperature=self.temperature, logprobs=2 * self.beam_width,
                              ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_list(value: object) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(_is_int(t) and t >= 0 for t in value)


def _fail(message: str) -> NoReturn:
    raise InvalidRequestError(message, param=message.split(" ", 1)[0])  # messages start with the field


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)

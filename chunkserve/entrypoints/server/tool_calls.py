"""What a chat request's `tools` and `tool_choice` ask of its decoding and of its answer,
following vLLM's rules:

- `tool_choice` defaults to "auto" when tools are given, else "none"; naming a function or
  "required" needs tools, and a named function must be one of them; "required" with no tools
  is "none". "auto" needs --enable-auto-tool-choice and --tool-call-parser (400 otherwise, in
  vLLM's words).
- "required" constrains decoding to a non-empty JSON array of {"name": one tool's name,
  "parameters": that tool's parameters} (vLLM's schema; `$defs` of the tools' schemas gathered
  at its root); a named function constrains it to that function's parameters schema, the whole
  answer then being the arguments of one call. Objects take only the properties their schema
  names, as under vLLM's default backend (xgrammar's strict mode; vLLM's
  disable_additional_properties gives its guidance backend the same): a call has no keys but
  its name and parameters. "auto" leaves decoding free and the server's
  parser (tool_parsers.py) finds calls in the text.
- finish_reason is "tool_calls" when "auto" found calls or "required" made them and the model
  stopped by itself; a named function's answer keeps "stop" (OpenAI's rule, as in vLLM).
- With parallel_tool_calls false only the first call is kept ("required" also asks the grammar
  for one item, so the model stops after it).

Streams: a call is announced by a delta with its index, id, type and name and empty arguments;
its arguments follow as fragments. "required" and named calls stream their arguments as the
model writes them; "auto" calls come whole once the parser has their JSON.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import json
from typing import Any

from chunkserve.entrypoints.server.openai_protocol import ChatCompletionRequest, ChatCompletionTool, NamedToolChoice
from chunkserve.entrypoints.server.tool_parsers import ToolCall, ToolParser, random_tool_call_id
from chunkserve.errors import InvalidRequestError
from chunkserve.sampling_params import SamplingParams, StructuredOutputsParams

Delta = dict[str, Any]  # a chat stream's delta: {"content": ...} or {"tool_calls": [...]}
AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # vLLM's schema for a tool without parameters


def resolve_tool_choice(body: ChatCompletionRequest) -> str | NamedToolChoice:
    """The request's tool_choice after vLLM's defaults and checks: "none", "auto", "required" or
    the named function (one of its tools)."""
    choice, tools = body.tool_choice, body.tools
    if choice is None:
        return "auto" if tools else "none"
    if choice == "none":
        return choice
    if tools is None:
        raise InvalidRequestError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice == "required" and not tools:
        return "none"
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools}:
        raise InvalidRequestError("The tool specified in `tool_choice` does not match any of the specified `tools`",
                                  "tool_choice")
    return choice


def required_schema(tools: list[ChatCompletionTool], parallel: bool = True) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": a non-empty array of calls, each {"name": a
    tool's name, "parameters": its parameters schema} (any of the tools). The tools' `$defs` move
    to the root, where their references point once the schemas are nested; two tools defining one
    name differently are refused, as in vLLM. `parallel` false: one call only. vLLM writes the
    items' "type": "object" beside the anyOf; here each branch carries it (the same set of
    arrays), so that closing objects (see the module's doc) closes each branch on its own
    properties rather than the outer object on none."""
    items, defs = [], {}
    for tool in tools:
        parameters = copy.deepcopy(tool.function.parameters) or dict(_EMPTY_PARAMETERS)
        for name, schema in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                raise InvalidRequestError(f"Tool definition '{name}' has multiple schemas, which is not supported.",
                                          "tools")
        items.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def named_schema(tools: list[ChatCompletionTool], name: str) -> dict[str, Any]:
    """The named function's parameters schema (an empty object's where it has none)."""
    tool = next(t for t in tools if t.function.name == name)
    return tool.function.parameters or dict(_EMPTY_PARAMETERS)


class ChatToolCalls:
    """One chat request's tool calling: its resolved tool_choice, what that does to its
    sampling parameters, and its answer's calls (`message`, or `stream` per choice)."""

    def __init__(self, body: ChatCompletionRequest, parser: type[ToolParser] | None) -> None:
        """`parser`: the server's --tool-call-parser class, None without --enable-auto-tool-choice."""
        self.choice = resolve_tool_choice(body)
        if self.choice == "auto" and parser is None:
            raise InvalidRequestError(AUTO_NEEDS_FLAGS, "tool_choice")
        self.tools = body.tools or []
        self.parser = parser
        self.parallel = body.parallel_tool_calls is not False
        self.named = self.choice.function.name if isinstance(self.choice, NamedToolChoice) else None
        if self.constrained and body.use_beam_search:
            raise InvalidRequestError("use_beam_search cannot be combined with tool_choice required or a named "
                                      "function: its beams are not constrained", "use_beam_search")

    @property
    def constrained(self) -> bool:
        """Whether decoding follows the tools' schema ("required" or a named function)."""
        return self.choice == "required" or self.named is not None

    @property
    def active(self) -> bool:
        """Whether the answer is read for calls at all."""
        return self.choice != "none"

    def field_names(self) -> dict[str, str]:
        """The body's names for the constraint's errors (an invalid parameters schema is the tools' fault)."""
        return {"structured_outputs": "tools", "structured_outputs.json": "tools' parameters"} if self.constrained \
            else {}

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """`params` with the tools' constraint (closed objects, see the module's doc), or with
        special tokens kept for a parser whose marker is one (vLLM's adjust_request)."""
        if self.constrained:
            if params.structured_outputs is not None:
                raise InvalidRequestError("tool_choice required or a named function constrains the output to the "
                                          "tools' schema: it cannot be combined with response_format or "
                                          "structured_outputs", "tool_choice")
            schema = (named_schema(self.tools, self.named) if self.named is not None
                      else required_schema(self.tools, self.parallel))
            return dataclasses.replace(params, structured_outputs=StructuredOutputsParams(
                json=schema, disable_additional_properties=True))
        if self.choice == "auto" and self.parser.keeps_special_tokens:
            return dataclasses.replace(params, skip_special_tokens=False)
        return params

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole answer -> the message's content and tool_calls, and the finish_reason."""
        if self.named is not None:
            return {"content": "", "tool_calls": [_call_dict(ToolCall(self.named, text))]}, finish_reason
        if self.choice == "required":
            calls = _required_calls(text)
            if calls is None:  # cut short (max_tokens, a stop string): the text as it is
                return {"content": text}, finish_reason
            calls = calls if self.parallel else calls[:1]
            return {"content": "", "tool_calls": [_call_dict(c) for c in calls]}, _calls_reason(finish_reason)
        if self.choice == "auto":
            answer = self.parser().parse(text)
            calls = answer.tool_calls if self.parallel else answer.tool_calls[:1]
            if calls:
                return ({"content": answer.content, "tool_calls": [_call_dict(c) for c in calls]},
                        _calls_reason(finish_reason))
        return {"content": text}, finish_reason

    def stream(self) -> CallStream:
        """A stream's reader of one choice's text."""
        if self.named is not None:
            return NamedCallStream(self.named)
        if self.choice == "required":
            return RequiredCallStream(self.parallel)
        return AutoCallStream(self.parser(), self.parallel)


class CallStream(abc.ABC):
    """One choice's text, as it is generated -> its stream's deltas."""

    def __init__(self) -> None:
        self.calls = 0  # calls announced so far

    @abc.abstractmethod
    def feed(self, text: str) -> list[Delta]:
        """The deltas that this piece of the choice's text decides."""

    def finish(self, finish_reason: str | None) -> tuple[list[Delta], str | None]:
        """The rest of the deltas once the choice has finished, and its finish_reason."""
        return [], _calls_reason(finish_reason) if self.calls else finish_reason

    def _announce(self, name: str, call_id: str | None = None) -> Delta:
        self.calls += 1
        return {"tool_calls": [{"index": self.calls - 1, "id": call_id or random_tool_call_id(), "type": "function",
                                "function": {"name": name, "arguments": ""}}]}

    def _arguments(self, text: str) -> Delta:
        return {"tool_calls": [{"index": self.calls - 1, "function": {"arguments": text}}]}


class NamedCallStream(CallStream):
    """A named function's answer: all of it is the call's arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> list[Delta]:
        if not text:
            return []
        head = [] if self.calls else [self._announce(self.name)]
        return [*head, self._arguments(text)]

    def finish(self, finish_reason: str | None) -> tuple[list[Delta], str | None]:
        return [], finish_reason  # a named call keeps the engine's reason (OpenAI's rule)


class AutoCallStream(CallStream):
    """tool_choice "auto": the server's parser splits content from calls; each call comes whole
    (announced, then its arguments in one fragment) once its JSON is complete."""

    def __init__(self, parser: ToolParser, parallel: bool) -> None:
        super().__init__()
        self.parser = parser
        self.parallel = parallel

    def feed(self, text: str) -> list[Delta]:
        return self._deltas(self.parser.feed(text))

    def finish(self, finish_reason: str | None) -> tuple[list[Delta], str | None]:
        deltas = self._deltas(self.parser.finish())
        return deltas, _calls_reason(finish_reason) if self.calls else finish_reason

    def _deltas(self, events: list[str | ToolCall]) -> list[Delta]:
        deltas: list[Delta] = []
        for event in events:
            if isinstance(event, str):
                deltas.append({"content": event})
            elif self.parallel or not self.calls:
                deltas += [self._announce(event.name, event.id), self._arguments(event.arguments)]
        return deltas


class RequiredCallStream(CallStream):
    """tool_choice "required": the answer is a JSON array of {"name": ..., "parameters": {...}}
    (the grammar sees to it). Read character by character: a call is announced once its name is
    complete, and its parameters' text streams as it comes (held until the name is known, should
    the model write parameters first)."""

    def __init__(self, parallel: bool) -> None:
        super().__init__()
        self.parallel = parallel
        self._text = ""
        self._stack: list[str] = []  # open arrays and objects
        self._in_string = self._escaped = False
        self._start = 0  # where the item's current key or value began
        self._key: str | None = None  # the item key whose value is being read
        self._value_open = False  # that value has begun (its first character was read)
        self._awaiting_value = False  # after the key's colon
        self._name: str | None = None
        self._announced = False  # the current item's call was announced
        self._arguments_from: int | None = None  # the parameters' text: from here
        self._arguments_to: int | None = None  # to here, once complete
        self._arguments_sent = 0  # characters of it already sent

    def feed(self, text: str) -> list[Delta]:
        deltas: list[Delta] = []
        base = len(self._text)
        self._text += text
        for offset, char in enumerate(text):
            deltas += self._read(base + offset, char)
        return deltas + self._send(len(self._text))

    def _read(self, index: int, char: str) -> list[Delta]:
        """One character of the answer; the deltas a finished call still owes."""
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
                if len(self._stack) == 2:  # an item's key, or a string value of it
                    if self._key is None:
                        self._key = json.loads(self._text[self._start: index + 1])
                    else:
                        self._value_ends(index + 1)
            return []
        if char.isspace():
            return []
        level = len(self._stack)
        if level == 2 and self._awaiting_value:
            self._awaiting_value, self._value_open, self._start = False, True, index
            if self._key == "parameters":
                self._arguments_from = index
        if char == '"':
            self._in_string = True
            if level == 2 and self._key is None:
                self._start = index
        elif char in "{[":
            self._stack.append(char)
            if len(self._stack) == 2:  # a new item
                self._name = self._arguments_from = self._arguments_to = None
                self._key, self._value_open, self._arguments_sent, self._announced = None, False, 0, False
        elif char in "}]":
            if level == 2:  # the item closes: a number, true, false or null before it ends there
                if self._value_open:
                    self._value_ends(index)
                self._stack.pop()
                return self._send(index, item_done=True)
            self._stack.pop()
            if len(self._stack) == 2 and self._value_open:  # the value (an object or array) closed
                self._value_ends(index + 1)
        elif char == ":" and level == 2:
            self._awaiting_value = True
        elif char == "," and level == 2 and self._value_open:
            self._value_ends(index)
        return []

    def _value_ends(self, end: int) -> None:
        if self._key == "name":
            try:
                self._name = json.loads(self._text[self._start:end])
            except ValueError:
                self._name = None
        elif self._key == "parameters":
            self._arguments_to = end
        self._key, self._value_open = None, False

    def _send(self, end: int, item_done: bool = False) -> list[Delta]:
        """The current call's announcement and the parameters' text up to `end` not yet sent."""
        if not isinstance(self._name, str) or (not self.parallel and self.calls and not self._announced):
            return []
        deltas = [] if self._announced else [self._announce(self._name)]
        self._announced = True
        if self._arguments_from is not None:
            stop = end if self._arguments_to is None else min(end, self._arguments_to)
            start = self._arguments_from + self._arguments_sent
            if stop > start:
                deltas.append(self._arguments(self._text[start:stop]))
                self._arguments_sent = stop - self._arguments_from
        if item_done:
            self._name = None
        return deltas


def _required_calls(text: str) -> list[ToolCall] | None:
    """The calls of a whole "required" answer; None if it is not a complete array of them."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, list) or not value or not all(
            isinstance(item, dict) and isinstance(item.get("name"), str) for item in value):
        return None
    return [ToolCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False)) for item in value]


def _call_dict(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _calls_reason(finish_reason: str | None) -> str | None:
    """"tool_calls" for an answer with calls that the model ended itself (vLLM's rule); a cut
    answer keeps its reason (e.g. "length")."""
    return "tool_calls" if finish_reason == "stop" else finish_reason

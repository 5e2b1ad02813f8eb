"""Tool calls in a model's free text (`tool_choice: "auto"`), one parser per format the
supported model families are trained to write (vLLM's parser names, --tool-call-parser):

- `hermes` (Hermes 2 Pro, Qwen 2.5 and 3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number of them, text around them;
- `llama3_json` (Llama 3.1+): the whole answer is `{"name": ..., "parameters": {...}}`, optionally
  after `<|python_tag|>`, several separated by `;`;
- `mistral` (Mistral 7B Instruct v0.3 and later): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`,
  or the newer `[TOOL_CALLS]name{...}`; `[TOOL_CALLS]` is a special token, so its requests are
  detokenized with skip_special_tokens off (as vLLM does).

A parser is fed the text as it is generated and gives back content text and finished calls
(`feed`, then `finish`); `parse` is the same over a whole answer, so a stream's deltas always
add up to the non-streamed answer. A call is given out only once its JSON is complete (not
argument by argument): a call whose JSON does not parse, or lacks a name, stays in the content
as the model wrote it. Whitespace between content and calls is dropped; an answer without
calls keeps its text exactly.
"""

from __future__ import annotations

import abc
import json
import random
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class ToolCall:
    """A call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: random_tool_call_id())


@dataclass
class ParsedAnswer:
    """An answer split into its content (None when only calls remain) and its calls."""

    content: str | None
    tool_calls: list[ToolCall]


Event = str | ToolCall  # content text, or a finished call


def random_tool_call_id() -> str:
    """vLLM's id for a call (and OpenAI-like: unique per call)."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolParser(abc.ABC):
    """Splits a model's text into content and tool calls as it is generated. Subclasses scan
    `self._pending` (text not yet decided) in `_scan`; this class holds back whitespace that
    may only separate content from a call."""

    name: ClassVar[str]
    # the format's call marker is a special token: the request's text must keep special tokens
    keeps_special_tokens: ClassVar[bool] = False
    # the keys a call's arguments may come under, in the order they are looked for
    argument_keys: ClassVar[tuple[str, ...]] = ("arguments",)

    def __init__(self) -> None:
        self._pending = ""
        self._held = ""  # trailing whitespace of the content so far: dropped if a call follows
        self._called = False

    def feed(self, text: str) -> list[Event]:
        """New text of the answer -> what is now known of it (content, finished calls)."""
        self._pending += text
        return self._release(self._scan(final=False))

    def finish(self) -> list[Event]:
        """The answer is complete: whatever was held back, as content or calls."""
        events = self._release(self._scan(final=True))
        if self._held and not self._called:
            events.append(self._held)
        self._held = ""
        return events

    def parse(self, text: str) -> ParsedAnswer:
        """A whole answer at once (what feeding it in pieces adds up to)."""
        events = self.feed(text) + self.finish()
        content = "".join(e for e in events if isinstance(e, str))
        calls = [e for e in events if isinstance(e, ToolCall)]
        return ParsedAnswer(content if content or not calls else None, calls)

    @classmethod
    def new_call_id(cls) -> str:
        return random_tool_call_id()

    @abc.abstractmethod
    def _scan(self, final: bool) -> list[Event]:
        """Consume what can be decided of `self._pending` (all of it when `final`)."""

    def _release(self, events: list[Event]) -> list[Event]:
        released: list[Event] = []
        for event in events:
            if isinstance(event, ToolCall):
                self._held, self._called = "", True
                released.append(event)
                continue
            text = self._held + event
            kept = text.rstrip()
            self._held = text[len(kept):]
            if kept:
                released.append(kept)
        return released

    def _call(self, value: Any, name: str | None = None) -> ToolCall | None:
        """A call from a decoded JSON object ({"name": ..., "arguments": {...}}), or from the
        arguments alone when the format writes the name outside the JSON; None if it is not one."""
        if name is None:
            if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
                return None
            name = value["name"]
            present = [key for key in self.argument_keys if key in value]
            value = value[present[0]] if present else {}
        if not isinstance(value, dict):
            return None
        return ToolCall(name, json.dumps(value, ensure_ascii=False), self.new_call_id())

    def _take_text_until(self, marker: str, final: bool, events: list[Event]) -> bool:
        """Move the pending text before `marker` to content and drop the marker: True if it
        was found. Otherwise the pending text goes to content, but for an end that may be the
        marker's beginning (unless `final`)."""
        at = self._pending.find(marker)
        if at >= 0:
            events.append(self._pending[:at])
            self._pending = self._pending[at + len(marker):]
            return True
        keep = 0 if final else _partial_suffix(self._pending, marker)
        cut = len(self._pending) - keep
        events.append(self._pending[:cut])
        self._pending = self._pending[cut:]
        return False


class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes 2 Pro, Qwen 2.5 / 3). An
    unclosed last call is parsed to the end of the answer, as vLLM does."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._in_call = False

    def _scan(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            if not self._in_call:
                if not self._take_text_until(self.START, final, events):
                    return events
                self._in_call = True
            at = self._pending.find(self.END)
            if at < 0 and not final:
                return events
            body = self._pending if at < 0 else self._pending[:at]
            raw = self.START + (self._pending if at < 0 else self._pending[: at + len(self.END)])
            self._pending = "" if at < 0 else self._pending[at + len(self.END):]
            self._in_call = False
            events.append(_decoded(body, self._call) or raw)


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1+'s JSON calls: the answer is `{"name": ..., "parameters": {...}}` (or
    "arguments"), optionally after `<|python_tag|>` (a special token, gone from the text unless
    special tokens are kept), several separated by `;`. An answer that does not start with a
    call is all content."""

    name = "llama3_json"
    argument_keys = ("parameters", "arguments")
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._state = "start"  # start -> calls -> (text); or start -> text

    def _scan(self, final: bool) -> list[Event]:
        events: list[Event] = []
        if self._state == "start":
            view = self._pending.lstrip()
            if view.startswith(self.PYTHON_TAG):
                view = view[len(self.PYTHON_TAG):].lstrip()
            elif not final and (not view or self.PYTHON_TAG.startswith(view)):
                return events
            if not view.startswith("{"):
                if not view and not final:
                    return events
                self._state = "text"
            else:
                self._state, self._pending = "calls", view
        while self._state == "calls":
            rest = self._pending.lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            if not rest:
                self._pending = "" if final else self._pending
                return events
            if not rest.startswith("{"):
                self._state, self._pending = "text", rest
                break
            end = json_end(rest)
            if end is None:
                if not final:
                    return events
                self._state, self._pending = "text", rest
                break
            call = _decoded(rest[:end], self._call)
            if call is None:
                self._state = "text"
                self._pending = rest
                break
            events.append(call)
            self._pending = rest[end:]
        if self._state == "text":
            events.append(self._pending)
            self._pending = ""
        return events


class MistralToolParser(ToolParser):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (Mistral's Hugging Face
    tokenizers, vLLM's "pre-v11" form) or `[TOOL_CALLS]name{...}` (v11 and later), text before."""

    name = "mistral"
    keeps_special_tokens = True
    MARKER = "[TOOL_CALLS]"
    _ID_CHARS = string.ascii_letters + string.digits

    def __init__(self) -> None:
        super().__init__()
        self._after_marker = False

    @classmethod
    def new_call_id(cls) -> str:
        """Mistral's templates take 9 alphanumeric characters (vLLM's MistralToolCall ids)."""
        return "".join(random.choices(cls._ID_CHARS, k=9))

    def _scan(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while True:
            if not self._after_marker:
                if not self._take_text_until(self.MARKER, final, events):
                    return events
                self._after_marker = True
            rest = self._pending.lstrip()
            if not rest and not final:
                return events
            array = rest.startswith("[")  # else v11's name{arguments}
            start = 0 if array else rest.find("{")
            name = "" if array else (rest if start < 0 else rest[:start]).strip()
            end = None
            if array or _is_name(name):
                end = None if start < 0 else json_end(rest, start)
                if end is None and not final:
                    return events  # the call so far
            self._after_marker = False
            calls = None if end is None else self._calls(rest[start:end], name)
            end = len(rest) if end is None else end
            if calls is None:  # not a call after all: the text as the model wrote it
                events.append(self.MARKER + self._pending[: len(self._pending) - len(rest) + end])
            else:
                events.extend(calls)
            self._pending = rest[end:]

    def _calls(self, text: str, name: str) -> list[ToolCall] | None:
        """The calls in the JSON after the marker: one object's arguments (v11, `name` given) or
        an array of calls."""
        if name:
            call = _decoded(text, lambda value: self._call(value, name))
            return None if call is None else [call]
        try:
            value = json.loads(text)
        except ValueError:
            return None
        calls = [self._call(item) for item in value] if isinstance(value, list) and value else [None]
        return None if any(call is None for call in calls) else calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,  # vLLM's name for the same parser
    "mistral": MistralToolParser,
}


def _decoded(text: str, make: Any) -> ToolCall | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return make(value)


def _is_name(text: str) -> bool:
    return bool(text) and all(c.isalnum() or c in "_-." for c in text)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a beginning of `marker` (shorter than it)."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def json_end(text: str, start: int = 0) -> int | None:
    """Where the JSON object or array opening at text[start] ends (the index after it), or None
    while it is unfinished. Only brackets outside strings count; whether it parses is json's call."""
    depth, in_string, escaped = 0, False, False
    for index in range(start, len(text)):
        char = text[index]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return index + 1
    return None


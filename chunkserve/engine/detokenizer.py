"""Incremental detokenization with stop strings.

Each step decodes only a short window of recent tokens: the text of
`ids[prefix_offset:]` minus the text of `ids[prefix_offset:read_offset]` is what the new
tokens added. A window whose text ends in U+FFFD is an unfinished multi-byte character:
nothing is emitted until the next token completes it.

The stop token that finishes a request (EOS or one of `stop_token_ids`) is taken without its
text unless `include_stop_str_in_output`, as vLLM does.

Stop strings are searched in the text; a match cuts the text before it (after it, with
`include_stop_str_in_output`) and finishes the request. While running, the last
`len(longest stop) - 1` characters are held back, so a stop string's first characters never
reach a stream before we know they are one; when stop strings are kept in the text nothing
needs holding back (vLLM's rule), but the search still looks back that far, for a stop string
that began in earlier text.
"""

from __future__ import annotations

from typing import Any

from chunkserve.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.search_back = max((len(s) for s in self.stop), default=1) - 1  # a stop string's start in older text
        self.hold_back = 0 if self.include_stop else self.search_back
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._num_emitted = 0

    def state(self) -> dict:
        """Where the detokenizer stands (JSON-ready; the token ids are the request's own)."""
        return {"text": self.text, "prefix_offset": self._prefix_offset, "read_offset": self._read_offset,
                "num_emitted": self._num_emitted}

    def restore(self, token_ids: list[int], state: dict) -> None:
        """Continue from `state` (of a detokenizer that had taken `token_ids`), so the next
        delta starts exactly where that one's last delta ended."""
        self.token_ids = list(token_ids)
        self.text = state["text"]
        self._prefix_offset, self._read_offset = state["prefix_offset"], state["read_offset"]
        self._num_emitted = state["num_emitted"]

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Take newly sampled tokens; returns the stop string they completed, if any."""
        for token_id in token_ids:
            self.token_ids.append(token_id)
            searched_from = max(len(self.text) - self.search_back, 0)
            self.text += self._decode_new_text()
            matched = self._find_stop(searched_from)
            if matched is not None:
                return matched
        return None

    def add_stop_token(self, token_id: int) -> None:
        """Take the stop token that finished the request, leaving its text out (what the tokens
        before it left unfinished is decoded first, as a finished request's is)."""
        if self._read_offset < len(self.token_ids):
            self.text += self._decode_new_text(final=True)
        self.token_ids.append(token_id)
        self._prefix_offset = self._read_offset = len(self.token_ids)

    def delta(self, finished: bool) -> str:
        """Text not yet handed out; all of it once the request has finished."""
        if finished and self._read_offset < len(self.token_ids):
            self.text += self._decode_new_text(final=True)  # an unfinished character, as U+FFFD
        end = len(self.text) if finished else max(len(self.text) - self.hold_back, self._num_emitted)
        new = self.text[self._num_emitted : end]
        self._num_emitted = end
        return new

    @property
    def emitted_text(self) -> str:
        """The concatenation of every delta handed out so far."""
        return self.text[: self._num_emitted]

    def _decode_new_text(self, final: bool = False) -> str:
        decode = self.tokenizer.decode
        prefix = decode(self.token_ids[self._prefix_offset : self._read_offset], skip_special_tokens=self.skip_special_tokens)
        full = decode(self.token_ids[self._prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        if len(full) <= len(prefix) or (full.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return full[len(prefix) :]

    def _find_stop(self, start: int) -> str | None:
        for stop in self.stop:
            index = self.text.find(stop, start)
            if index != -1:
                self.text = self.text[: index + len(stop) if self.include_stop else index]
                return stop
        return None

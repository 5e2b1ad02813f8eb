"""vLLM's /tokenize and /detokenize bodies."""

from __future__ import annotations

from chunkserve.entrypoints.server.openai_protocol import ChatMessage, ChatTemplateFields
from chunkserve.entrypoints.server.protocol import Body, TokenIds


class TokenizeRequest(ChatTemplateFields):
    """vLLM's /tokenize: a prompt, or messages through the chat template (with the chat fields)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # vLLM's defaults: true for a prompt, false for messages
    return_token_strs: bool = False


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: TokenIds

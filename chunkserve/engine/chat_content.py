"""OpenAI's chat content parts, in the forms vLLM takes: `{"type": "text", "text": ...}`,
`{"type": "image_url", "image_url": {"url": ...}}` (or `"image_url": URL`) and vLLM's offline
`{"type": "image_pil", "image_pil": image}`, mixed in any order. Chat templates of vision models
(LLaVA, SmolVLM, Qwen2-VL) render Hugging Face's convention instead, `{"type": "image"}` where
an image goes, so the images are taken out of the messages here, in order, and each is named
by where the request gave it (messages[0].content[1]) for the errors about it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chunkserve.errors import InvalidRequestError

IMAGE_PART_TYPES = ("image_url", "image_pil")
PART_TYPES = ("text", *IMAGE_PART_TYPES)


@dataclass(frozen=True)
class ImageItem:
    param: str  # where the request gave it, e.g. messages[0].content[1]
    url: str | None = None  # an image_url part's URL
    image: Any = None  # an image_pil part's PIL image


def split_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[ImageItem]]:
    """The messages as the chat template takes them (each image part an `{"type": "image"}`,
    text parts as they are) and their images in order. Messages without images are returned as
    they are. Raises InvalidRequestError naming a malformed part."""
    rendered, images = [], []
    for m_index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(_type_of(p) in IMAGE_PART_TYPES for p in content):
            rendered.append(message)
            continue
        parts = []
        for p_index, part in enumerate(content):
            param = f"messages[{m_index}].content[{p_index}]"
            kind = _type_of(part)
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise InvalidRequestError("a text part needs text (a string)", param)
                parts.append({"type": "text", "text": part["text"]})
                continue
            if kind not in IMAGE_PART_TYPES:
                raise InvalidRequestError(f"content part type {kind!r} is not supported; supported: "
                                          f"{', '.join(PART_TYPES)}", param)
            images.append(_image_item(part, kind, param))
            parts.append({"type": "image"})
        rendered.append({**message, "content": parts})
    return rendered, images


def content_chars(content: Any) -> int:
    """Characters of a message's text: its string, or its text parts'."""
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if _type_of(p) == "text" and isinstance(p.get("text"), str))
    return len(content) if isinstance(content, str) else 0


def _image_item(part: dict[str, Any], kind: str, param: str) -> ImageItem:
    value = part.get(kind)
    if kind == "image_pil":
        if not hasattr(value, "size") or not hasattr(value, "convert"):
            raise InvalidRequestError("an image_pil part needs image_pil (a PIL image)", param)
        return ImageItem(param, image=value)
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise InvalidRequestError('an image_url part needs image_url: {"url": URL} or a URL string', param)
    return ImageItem(param, url=url)


def _type_of(part: Any) -> Any:
    return part.get("type") if isinstance(part, dict) else None

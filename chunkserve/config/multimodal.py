"""Where a request's images may come from and how many and how large they may be, checked by the
frontend before any engine work (vLLM's flag names where vLLM has them). Remote URLs are off
unless --allowed-media-domains names their hosts (vLLM fetches any URL by default: a server
that fetches what a client names can be made to reach its own network), and local files are
read only under --allowed-local-media-path."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from chunkserve.config.fields import arg, parse_json_object
from chunkserve.errors import InvalidRequestError

MODALITIES = ("image",)  # what requests may carry; vLLM's video and audio are refused by name
DEFAULT_LIMIT_PER_PROMPT = 999  # vLLM's, for a modality --limit-mm-per-prompt leaves out
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024  # OpenAI's limit on one image
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096


@dataclass(frozen=True)
class MultiModalConfig:
    limit_mm_per_prompt: str | dict[str, int] | None = arg(
        None, "most items of each modality one prompt may carry, as JSON (vLLM's form): '{\"image\": 2}' "
              f"(default: {DEFAULT_LIMIT_PER_PROMPT} images)"
    )
    allowed_local_media_path: str = arg(
        "", "a folder whose files requests may name as file:// image URLs (resolved: no leaving it by .. or a "
            "symlink); empty: file:// URLs are refused"
    )
    allowed_media_domains: list[str] | None = arg(
        None, "hosts whose http(s) image URLs the server fetches; without it, remote image URLs are refused",
        nargs="+"
    )
    max_image_bytes: int = arg(DEFAULT_MAX_IMAGE_BYTES, "largest encoded image one request may send, in bytes")
    max_image_pixels: int = arg(DEFAULT_MAX_IMAGE_PIXELS, "most pixels (width x height) of one decoded image")

    def __post_init__(self) -> None:
        self.limits()
        path = self.allowed_local_media_path
        if path and not os.path.isdir(path):
            raise InvalidRequestError(f"allowed_local_media_path {path!r} is not a folder")
        for name in ("max_image_bytes", "max_image_pixels"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be positive, got {getattr(self, name)}")

    def limits(self) -> dict[str, int]:
        """--limit-mm-per-prompt parsed: modality -> most items per prompt."""
        given = self.limit_mm_per_prompt
        parsed = {} if given is None else parse_json_object("limit_mm_per_prompt", given, set(MODALITIES))
        for modality, limit in parsed.items():
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
                raise InvalidRequestError(f"limit_mm_per_prompt {modality} must be a count (an integer >= 0), "
                                          f"got {json.dumps(limit)}")
        return {modality: parsed.get(modality, DEFAULT_LIMIT_PER_PROMPT) for modality in MODALITIES}

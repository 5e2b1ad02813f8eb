"""A request's images from the URLs it names: `data:image/...;base64,` URLs, `file://` paths
under --allowed-local-media-path, http(s) URLs of the hosts --allowed-media-domains names. Every
image is bounded in bytes before it is decoded and in pixels before its pixels are read (a small
PNG can claim gigapixels), and whatever is wrong with one is an InvalidRequestError naming the
request's part (`param`, e.g. messages[0].content[1]), raised before any engine work."""

from __future__ import annotations

import base64
import binascii
import io
import os
from typing import Any
from urllib.parse import unquote, urlsplit

from chunkserve.config.multimodal import MultiModalConfig
from chunkserve.errors import InvalidRequestError

FETCH_TIMEOUT_S = 5.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT
SHOWN_URL_CHARS = 60  # of a URL quoted in an error (a data URL can be megabytes)


class MediaLoader:
    """Loads and checks images under one server's MultiModalConfig."""

    def __init__(self, config: MultiModalConfig) -> None:
        self.config = config
        path = config.allowed_local_media_path
        self.local_root = os.path.realpath(path) if path else None
        self.domains = frozenset(d.lower() for d in config.allowed_media_domains or ())

    def load_image(self, url: str, param: str) -> Any:
        """The image `url` names, decoded to an RGB PIL image (vLLM's conversion)."""
        if not isinstance(url, str) or not url:
            raise InvalidRequestError("an image_url needs a url (a data:, file:// or http(s) URL)", param)
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            data = self._data_url_bytes(url, param)
        elif scheme == "file":
            data = self._file_bytes(url, param)
        elif scheme in ("http", "https"):
            data = self._fetch(url, param)
        else:
            raise InvalidRequestError(f"image URL {_shown(url)} is not a data:, file:// or http(s) URL", param)
        return self.decode(data, param).convert("RGB")

    def decode(self, data: bytes, param: str) -> Any:
        """`data` decoded by Pillow, its size checked before its pixels are read."""
        from PIL import Image, UnidentifiedImageError

        if not data:
            raise InvalidRequestError("the image is empty (0 bytes)", param)
        self._check_bytes(len(data), param)
        try:
            image = Image.open(io.BytesIO(data))
            self.check_pixels(image, param)
            image.load()
        except InvalidRequestError:
            raise
        except UnidentifiedImageError:
            raise InvalidRequestError("the image cannot be decoded: its bytes are not an image format Pillow reads "
                                      "(PNG, JPEG, GIF, WebP, ...)", param) from None
        except Exception as error:  # Pillow's decoders raise many kinds on bad input
            raise InvalidRequestError(f"the image cannot be decoded: {error}", param) from None
        return image

    def check_pixels(self, image: Any, param: str) -> None:
        """An image (a PIL image, decoded or not) against --max-image-pixels."""
        width, height = image.size
        if width < 1 or height < 1:
            raise InvalidRequestError(f"the image is empty ({width}x{height} pixels)", param)
        if width * height > self.config.max_image_pixels:
            raise InvalidRequestError(f"the image has {width}x{height} pixels, over the limit of "
                                      f"{self.config.max_image_pixels} (--max-image-pixels)", param)

    def _check_bytes(self, size: int, param: str) -> None:
        if size > self.config.max_image_bytes:
            raise InvalidRequestError(f"the image has {size} bytes or more, over the limit of "
                                      f"{self.config.max_image_bytes} (--max-image-bytes)", param)

    def _data_url_bytes(self, url: str, param: str) -> bytes:
        header, comma, payload = url.partition(",")
        media_type, *options = header[len("data:"):].split(";")
        if not comma or "base64" not in options or not media_type.lower().startswith("image/"):
            raise InvalidRequestError(f"a data URL must be data:image/<type>;base64,<data>; got {_shown(url)}", param)
        self._check_bytes(len(payload) * 3 // 4, param)  # before decoding it
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidRequestError("the data URL's image is not valid base64", param) from None

    def _file_bytes(self, url: str, param: str) -> bytes:
        if self.local_root is None:
            raise InvalidRequestError("file:// image URLs are refused: the server reads local files only under "
                                      "--allowed-local-media-path", param)
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise InvalidRequestError(f"file:// URL {_shown(url)} names a host; give file:///absolute/path", param)
        path = os.path.realpath(unquote(parts.path))  # .. and symlinks resolved before the check
        if os.path.commonpath([path, self.local_root]) != self.local_root:
            raise InvalidRequestError(f"file:// URL {_shown(url)} is outside --allowed-local-media-path", param)
        try:
            with open(path, "rb") as file:
                self._check_bytes(os.fstat(file.fileno()).st_size, param)
                return file.read(self.config.max_image_bytes + 1)
        except OSError as error:
            raise InvalidRequestError(f"file:// URL {_shown(url)} cannot be read: {error.strerror}", param) from None

    def allows_host(self, url: str) -> bool:
        """Whether --allowed-media-domains names the host of the http(s) URL `url`."""
        host = urlsplit(url).hostname
        return host is not None and host.lower() in self.domains

    def _fetch(self, url: str, param: str) -> bytes:
        if not self.allows_host(url):
            raise InvalidRequestError(f"image URL {_shown(url)} is refused: the server fetches remote images only "
                                      "from the hosts --allowed-media-domains names; send the image as a "
                                      "data:image/...;base64 URL instead", param)
        import httpx

        try:  # redirects are not followed: they could leave the allowed hosts
            with httpx.stream("GET", url, timeout=FETCH_TIMEOUT_S, follow_redirects=False) as response:
                if response.status_code != 200:
                    raise InvalidRequestError(f"image URL {_shown(url)} answered HTTP {response.status_code}", param)
                data = bytearray()
                for chunk in response.iter_bytes():
                    data += chunk
                    self._check_bytes(len(data), param)
                return bytes(data)
        except httpx.HTTPError as error:
            raise InvalidRequestError(f"image URL {_shown(url)} could not be fetched: {error}", param) from None


def _shown(url: str) -> str:
    return repr(url if len(url) <= SHOWN_URL_CHARS else url[:SHOWN_URL_CHARS] + "...")

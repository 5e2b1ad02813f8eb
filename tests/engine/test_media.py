"""Images from the URLs a request names: data: URLs decoded, file:// only under
--allowed-local-media-path (no leaving it by .. or a symlink), http(s) only for the hosts
--allowed-media-domains names, and every broken, empty or oversized image a 400 naming the part."""

from __future__ import annotations

import base64
import os

import pytest

from chunkserve.config.engine import EngineArgs
from chunkserve.config.multimodal import MultiModalConfig
from chunkserve.engine.media import MediaLoader
from chunkserve.errors import InvalidRequestError
from tests.multimodal_models import png_data_url, random_image, save_png

PART = "messages[0].content[1]"


@pytest.fixture(scope="module")
def media_root(tmp_path_factory):
    """An allowed folder holding an image, and an image beside it (outside)."""
    base = tmp_path_factory.mktemp("media")
    allowed = base / "allowed"
    allowed.mkdir()
    save_png(random_image(1), str(allowed), "inside.png")
    save_png(random_image(2), str(base), "outside.png")
    os.symlink(base / "outside.png", allowed / "escape.png")
    return base


def loader(**fields) -> MediaLoader:
    return MediaLoader(MultiModalConfig(**fields))


def refused(loader_: MediaLoader, url: str, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as error:
        loader_.load_image(url, PART)
    assert error.value.param == PART


def test_a_data_url_gives_the_image_it_encodes():
    original = random_image(3, 20, 10)
    image = loader().load_image(png_data_url(original), PART)
    assert image.mode == "RGB" and image.size == (20, 10) and image.tobytes() == original.tobytes()


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "cannot be decoded"),
    ("data:image/png;base64,", r"empty \(0 bytes\)"),
    ("data:image/png;base64,%%%%", "not valid base64"),
    ("data:text/plain;base64,aGk=", "data:image/<type>;base64"),
    ("data:image/png,rawbytes", "data:image/<type>;base64"),
    ("ftp://example.com/a.png", "not a data:, file:// or http"),
    ("", "needs a url"),
])
def test_a_broken_or_empty_image_is_refused_naming_the_part(url, message):
    refused(loader(), url, message)


def test_a_truncated_png_is_refused():
    data = base64.b64decode(png_data_url(random_image(4)).split(",", 1)[1])
    refused(loader(), "data:image/png;base64," + base64.b64encode(data[: len(data) // 2]).decode(),
            "cannot be decoded")


def test_oversized_images_are_refused_by_bytes_and_by_pixels():
    url = png_data_url(random_image(5, 48, 40))
    refused(loader(max_image_bytes=1000), url, r"over the limit of 1000 \(--max-image-bytes\)")
    refused(loader(max_image_pixels=48 * 40 - 1), url, r"48x40 pixels, over the limit of 1919 \(--max-image-pixels\)")
    assert loader(max_image_pixels=48 * 40).load_image(url, PART).size == (48, 40)


def test_file_urls_are_read_only_under_the_allowed_path(media_root):
    allowed = str(media_root / "allowed")
    assert loader(allowed_local_media_path=allowed).load_image(f"file://{allowed}/inside.png", PART).size == (48, 40)
    refused(loader(), f"file://{allowed}/inside.png", "--allowed-local-media-path")
    inside_only = loader(allowed_local_media_path=allowed)
    refused(inside_only, f"file://{media_root}/outside.png", "outside --allowed-local-media-path")
    refused(inside_only, f"file://{allowed}/../outside.png", "outside --allowed-local-media-path")
    refused(inside_only, f"file://{allowed}/escape.png", "outside --allowed-local-media-path")  # a symlink out
    refused(inside_only, f"file://{allowed}/missing.png", "cannot be read")


def test_remote_urls_are_refused_unless_their_host_is_allowed():
    refused(loader(), "https://example.com/cat.png", "--allowed-media-domains")
    allowing = loader(allowed_media_domains=["images.example.com"])
    assert allowing.allows_host("https://images.example.com/cat.png")
    assert allowing.allows_host("http://IMAGES.example.com:8080/cat.png")
    assert not allowing.allows_host("https://example.com/cat.png")
    assert not allowing.allows_host("https://images.example.com.evil.org/cat.png")
    assert not allowing.allows_host("https://images.example.com@evil.org/cat.png")
    refused(allowing, "https://evil.org/cat.png", "--allowed-media-domains")


@pytest.mark.parametrize("fields, message", [
    (dict(limit_mm_per_prompt='{"image": -1}'), "limit_mm_per_prompt image must be a count"),
    (dict(limit_mm_per_prompt='{"video": 1}'), "unknown key"),
    (dict(limit_mm_per_prompt="{image: 2}"), "not valid JSON"),
    (dict(allowed_local_media_path="/no/such/folder"), "is not a folder"),
    (dict(max_image_bytes=0), "max_image_bytes must be positive"),
])
def test_the_multimodal_flags_are_checked_at_start(fields, message):
    with pytest.raises(InvalidRequestError, match=message):
        MultiModalConfig(**fields)
    assert MultiModalConfig(limit_mm_per_prompt='{"image": 2}').limits() == {"image": 2}
    flags = EngineArgs(limit_mm_per_prompt='{"image": 2}', allowed_media_domains=["a.example"], max_image_pixels=9)
    assert flags.multimodal_config() == MultiModalConfig('{"image": 2}', "", ["a.example"], max_image_pixels=9)

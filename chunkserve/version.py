"""The package's version, as its metadata (pyproject.toml) gives it."""

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("chunkserve")
except PackageNotFoundError:  # run from a source tree that was never installed
    VERSION = "0.1.0+unknown"

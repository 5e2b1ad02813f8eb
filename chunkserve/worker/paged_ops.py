"""The C++ attention op that reads the paged KV cache in place (csrc/paged_attention.cpp).

It is compiled on first use with `torch.utils.cpp_extension` (about a minute on 2 cores; the
build is cached under ~/.cache/torch_extensions) for the machine it runs on; `make install`
builds it once (`build_report`). Where no C++ compiler is available
the engine keeps the plain-torch attention, which is also the reference the tests compare
the op against.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "cpp", "torch")
_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "paged_attention.cpp")

# (q, k_cache, v_cache, block_tables, context_lens, block_size, scale) -> attention output
DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float],
                        torch.Tensor]


@functools.cache
def build_decode_kernel() -> DecodeKernel:
    """Compile (or load the cached build of) the op; raises if it cannot be built."""
    from torch.utils.cpp_extension import load

    try:  # the `ninja` wheel's binary, which is not on PATH unless the venv is activated
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    logger.info("loading the C++ paged attention op (compiled on first use: about a minute)")
    module = load(name="chunkserve_paged_attention", sources=[_SOURCE],
                  extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"], extra_ldflags=["-fopenmp"])
    return module.paged_decode_attention


def decode_kernel_for(backend: str) -> DecodeKernel | None:
    """The op for `backend`: "cpp" must build, "auto" falls back to None (torch) with a
    warning, "torch" is always None."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return None
    try:
        return build_decode_kernel()
    except Exception as error:  # no compiler, no ninja, a failed build
        if backend == "cpp":
            raise
        logger.warning("the C++ paged attention op could not be built (%s); using the torch attention", error)
        return None


def build_report() -> str:
    """Build the op now (as `make install` does) and say whether it worked; never raises."""
    try:
        build_decode_kernel()
        return "the C++ paged attention op is built"
    except Exception as error:  # reported, not fatal: the engine falls back to the torch attention
        return f"the C++ paged attention op is not available here ({error}); the torch attention will serve"

"""The worker's C++ ops (csrc/), and the choice between them and plain torch.

- `paged_decode_attention` (csrc/paged_attention.cpp): decode attention that reads each
  request's KV in place through its block table.
- `paged_prefill_attention` (csrc/prefill_attention.cpp): a prefill chunk's causal attention
  over its history and its own keys, read in place through the block table. With
  `deterministic`, and `deterministic_decode_attention` (each decode a 1-row chunk of it), a
  query row's bits depend only on its position and keys, never on the path that computes it
  (`attention_kernels(deterministic=True)`, issue 42).
- `small_batch_linear` (csrc/small_batch_linear.cpp): the linear layers when a step has at
  most `SMALL_BATCH_MAX_ROWS` rows, where it beats MKL's GEMM on this model's shapes (far
  from the weight-bandwidth bound at a few rows, behind the kernel's tiles at hundreds);
  `block_quantized_linear` is the same reading a GGUF model's Q4_0/Q4_1/Q8_0 blocks instead
  of their float32 dequantization (3.8-7x fewer bytes per step, the same result); where the
  CPU has AVX-512 it expands the blocks in registers (csrc/block_linear_avx512.cpp), chosen at
  run time (`cpu_isa`), the AVX2 path kept for the CPUs without. With `--int8-activations`
  (`model_ops(int8_activations=True)`) it quantizes x to 8 bits per block of 32 first and
  multiplies with AVX-512 VNNI's integer dot products (csrc/block_linear_vnni.cpp), llama.cpp's
  numerics, under their own accuracy contract (docs/PRECISION.md).
- `dequantized_linear`, `bf16_dot_linear` (csrc/deterministic_linear.cpp): deterministic mode's
  linears (`model_ops(deterministic=True)`, deterministic_ops.py), one reduction order per
  output element for every row count; `deterministic_decoder_layers` and
  `deterministic_bf16_decoder_layers` are `decoder_layers` (below) with them. bfloat16 mode's
  decode steps take `bf16_dot_linear` on the GGUF blocks too, from two rows, where a weight has
  no interleaved copy (below; `bf16_mode_block_linear`, and `bf16_decoder_layers` with it).
- `interleaved_bf16_linear` (csrc/interleaved_bf16_linear.cpp): bfloat16 mode's decode steps on
  the GGUF blocks interleaved once at load (`pack_interleaved_blocks`, `BlockWeight.interleaved`:
  a second copy of the blocks' bytes) so that each SIMD lane works for one output feature and a
  thread streams its weights front to back; AVX512_BF16 pair dot products on the exact weights.
- `rms_norm`, `add_rms_norm`, `rotary_embedding`, `silu_and_mul` (csrc/elementwise.cpp): a
  layer's small ops, one call each instead of a chain of torch calls.
- `decoder_layers` (csrc/decoder_layer.cpp): the ops above for the decoder layers of a pure
  decode step, from one call for the whole stack instead of some thirty a layer (Python, pybind
  and the GIL at each).
- Not ours but torch's: oneDNN's linear on weights packed once at load (`onednn_linear`), for
  the layers' steps of `ONEDNN_MIN_ROWS` rows and more, where it beats both MKL and our kernel.
  In bfloat16 mode (`model_ops(torch.bfloat16)`) the packed weight is bfloat16 and oneDNN
  takes the steps of `BF16_ONEDNN_MIN_ROWS` rows and more, the GGUF blocks the fewer
  (`bf16_mode_block_linear`: bfloat16 products by `interleaved_bf16_linear`), and
  every step of a layer without blocks (`onednn_bf16_linear`). The attention
  ops read a float32 or a bfloat16 KV cache; over a bfloat16 one the prefill op multiplies in
  bfloat16 where the CPU has AVX512_BF16 (outside deterministic mode). Where the CPU has AMX, chunks
  of `AMX_PREFILL_MIN_CONTEXT` keys or more over a bfloat16 cache take torch's flash attention
  instead, which multiplies on AMX tiles (`amx_prefill_attention`).

The last five reach the model as a `ModelOps` (model/ops.py), whose plain-torch set
`TORCH_OPS` they are tested against.

They are compiled with `torch.utils.cpp_extension` for the machine they run on (about a
minute on 2 cores) into the Python environment's own folder (`build_directory`); `make
install` builds them once (`build_report`). Where no C++ compiler is available the engine
keeps plain torch, which is also the reference the tests compare the ops against.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from chunkserve.config.cpu import native_amx_bf16
from chunkserve.config.engine import OP_BACKENDS
from chunkserve.errors import InvalidRequestError
from chunkserve.ops.deterministic_ops import deterministic_model_ops
from chunkserve.ops.model_ops import BlockWeight, ModelOps, torch_ops

logger = logging.getLogger(__name__)

_CSRC = os.path.join(os.path.dirname(__file__), "csrc")
_SOURCES = [os.path.join(_CSRC, name)
            for name in ("ops.cpp", "cpu_isa.cpp", "paged_attention.cpp", "prefill_attention.cpp",
                         "small_batch_linear.cpp", "block_linear_avx512.cpp", "block_linear_vnni.cpp",
                         "elementwise.cpp", "decoder_layer.cpp", "deterministic_linear.cpp",
                         "interleaved_bf16_linear.cpp")]

# Up to this many rows the C++ linear beats or equals MKL on the layer shapes of SmolLM2-135M
# here, in the layers alone (benchmarks/kernels/small_batch_linear.py) and in whole steps
# (benchmarks/engine/step_time_curve.py); above, MKL's blocked GEMM wins, on the MLP's down
# projection (K = 1536) first. Measured: docs/benchmarks-log.md, "Decode steps: the C++ ops
# against plain torch" (small_batch_linear.cpp).
SMALL_BATCH_MAX_ROWS = 512
# From this many rows oneDNN's linear on packed weights beats the C++ kernel, on float32
# weights and on the GGUF blocks alike; below, the kernel reading the blocks moves fewer bytes.
# Layers whose weight could not be packed keep the rules above. Measured: docs/benchmarks-log.md,
# "oneDNN's linear on packed weights" (the layers) and "Step time against rows, and the chunk
# alignment" (whole steps).
ONEDNN_MIN_ROWS = 32
# In bfloat16 mode, from this many rows oneDNN's bfloat16 linear takes a layer's steps from the
# C++ kernels on its GGUF blocks (`bf16_mode_block_linear`): below, they read fewer bytes, with
# bfloat16 products as oneDNN's. Measured in whole steps: docs/benchmarks-log.md, "bfloat16
# products for decode steps of 2-19 rows" and "Decode rows on interleaved blocks".
BF16_ONEDNN_MIN_ROWS = 32
# interleaved_bf16_linear reads a weight's features in records of this many (its csrc file).
INTERLEAVED_FEATURES = 16
# The LM head (49152 x 576) is a shape MKL handles poorly: the C++ kernel is faster up to
# 1024 rows at least (measured: docs/benchmarks-log.md, "Decode steps: the C++ ops against
# plain torch").
LOGITS_MAX_ROWS = 1024


def pack_for_onednn(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
    """The float32 `weight` [out, in] as `dtype` (float32 or bfloat16), reordered once into
    oneDNN's blocked layout for `onednn_linear` (`onednn_bf16_linear`), or None where this
    torch cannot or the weight is not float32. The layout is chosen for a 256-row batch; any
    row count runs on it."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or not _onednn_packing_works(dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype).contiguous(), 256)


@functools.cache
def _onednn_packing_works(dtype: torch.dtype = torch.float32) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 256)
        return True
    except (RuntimeError, AttributeError) as error:  # a build whose oneDNN lacks the op
        logger.warning("oneDNN cannot pack weights here (%s); the layers keep the C++ kernel and MKL", error)
        return False


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear on a weight from `pack_for_onednn` (the op torch's inductor uses for frozen CPU
    linears): on this host oneDNN's kernels run this model's shapes faster than MKL's SGEMM,
    which F.linear calls (measured: docs/benchmarks-log.md, "oneDNN's linear on packed weights")."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def onednn_bf16_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear on a bfloat16 weight from `pack_for_onednn`, float32 in and out: x is rounded
    to bfloat16, oneDNN accumulates in float32 and rounds the result to bfloat16 (torch's op
    writes its input's dtype), which returns widened to float32; the bias is added in float32."""
    out = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, None, "none", [], "").float()
    return out if bias is None else out.add_(bias)


# From this many keys (a chunk's history and its own) torch's flash attention on AMX tiles beats
# the C++ prefill op: 512 tokens from the first position 1.3x, 512 after 1536 2.2x; at 256 it is
# slower (measured: docs/benchmarks-log.md, "Prefill attention on AMX tiles").
AMX_PREFILL_MIN_CONTEXT = 512


def amx_prefill_attention(cpp_prefill: Callable[..., torch.Tensor], q: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, block_table: torch.Tensor, start: int, block_size: int,
                          scale: float) -> torch.Tensor:
    """A prefill chunk's attention (a `PrefillKernel` once `cpp_prefill`, the C++ op, is bound)
    for a CPU with AMX: a chunk over a bfloat16 KV cache that attends AMX_PREFILL_MIN_CONTEXT keys
    or more by torch's flash attention in bfloat16, which multiplies on AMX tiles, about twice the
    C++ op's rate there (docs/benchmarks-log.md, "Prefill attention on AMX tiles"); shorter ones,
    where its several parallel regions cost more than they save, and a float32 cache (float32
    mode, a float32 draft model) by the C++ op. The keys and values are gathered from the blocks,
    the queries rounded to bfloat16 as the C++ op rounds them, and the output rounded to bfloat16
    too (one rounding more than the C++ op's float32 sums) and widened back. Queries at positions
    [start, start + n) see keys [0, start + i]."""
    if k_cache.dtype != torch.bfloat16 or start + q.shape[0] < AMX_PREFILL_MIN_CONTEXT:
        return cpp_prefill(q, k_cache, v_cache, block_table, start, block_size, scale)
    context = start + q.shape[0]
    slots = (block_table[:, None] * block_size + torch.arange(block_size)).reshape(-1)[:context]
    keys = k_cache[slots].transpose(0, 1).unsqueeze(0)  # (1, kv_heads, context, D)
    values = v_cache[slots].transpose(0, 1).unsqueeze(0)
    queries = q.to(torch.bfloat16).transpose(0, 1).unsqueeze(0)  # (1, heads, n, D)
    attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=_later_chunk_mask(start, context),
                                              is_causal=not start, scale=scale, enable_gqa=True)
    return attended.squeeze(0).transpose(0, 1).float()


@functools.lru_cache(maxsize=16)
def _later_chunk_mask(start: int, context: int) -> torch.Tensor | None:
    """[context - start, context] True where query start + i sees key j (j <= start + i): causal
    aligned bottom-right, which SDPA's `is_causal` (top-left) is only where start == 0 (None).
    Cached: every layer of a step attends the same chunks (never written to)."""
    return torch.arange(context)[None, :] <= torch.arange(start, context)[:, None] if start else None


# (q, k_cache, v_cache, block_tables, context_lens, block_size, scale) -> attention output
DecodeKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float],
                        torch.Tensor]

# (q, k_cache, v_cache, block_table, start, block_size, scale) -> attention output of one chunk
PrefillKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, float], torch.Tensor]


@dataclass(frozen=True)
class AttentionKernels:
    """The two attention ops that read the paged KV in place (the step's batch carries them)."""

    decode: DecodeKernel
    prefill: PrefillKernel


@dataclass(frozen=True)
class CppOps:
    """The compiled functions, as bound from csrc/ops.cpp (signatures in csrc/ops.h)."""

    decode_attention: DecodeKernel
    prefill_attention: Callable[..., torch.Tensor]  # a PrefillKernel, and `deterministic=` (csrc/ops.h)
    deterministic_decode_attention: DecodeKernel
    small_batch_linear: Callable[..., torch.Tensor]
    block_quantized_linear: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[..., torch.Tensor]
    onednn_linear: Callable[..., torch.Tensor]
    onednn_bf16_linear: Callable[..., torch.Tensor]
    pack_linear_weight: Callable[[torch.Tensor, torch.dtype], torch.Tensor | None]
    decoder_layers: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    # (x, float32 weight, bias), one order per element: on dequantized blocks, block_quantized_linear's bits
    dequantized_linear: Callable[..., torch.Tensor]
    bf16_dot_linear: Callable[..., torch.Tensor]  # (x, weight or blocks, ggml_type or -1, bias), one order each
    # (x, blocks, ggml_type, bias, int8_activations, interleaved): bfloat16 mode's few-row steps on GGUF blocks
    bf16_mode_block_linear: Callable[..., torch.Tensor]
    # (blocks, ggml_type) -> the blocks in interleaved_bf16_linear's layout (N a multiple of 16)
    pack_interleaved_blocks: Callable[[torch.Tensor, int], torch.Tensor]
    interleaved_bf16_linear: Callable[..., torch.Tensor]  # (x [M, K], packed, ggml_type, bias), bfloat16 products
    round_to_bf16: Callable[[torch.Tensor], torch.Tensor]  # a float32 weight as bf16_dot_linear reads it
    bf16_dot_supported: Callable[[], bool]  # whether bf16_dot_linear runs here (AVX512_BF16)
    deterministic_decoder_layers: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # with deterministic float32
    bf16_decoder_layers: Callable[..., tuple[torch.Tensor, torch.Tensor]]  # with bf16_mode_block_linear
    # `decoder_layers` with bf16_dot_linear and deterministic_decode_attention
    deterministic_bf16_decoder_layers: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    cpu_has_vnni: Callable[[], bool]  # whether `block_quantized_linear` can take int8_activations here
    cpu_isa: Callable[[], str]  # the instruction set of the kernels that have several: avx512, avx2, portable
    set_cpu_isa: Callable[[str], str]  # another one this CPU has (tests, benchmarks); returns the last

    def attention_kernels(self, deterministic: bool = False, amx: bool | None = None) -> AttentionKernels:
        """The in-place attention ops; where `deterministic`, ones that give a query row the same
        bits whether it decodes (beside any other decodes), sits at any row of a prefill chunk
        of any start and length, or is verified: decode rows as 1-row chunks of the prefill op.
        Otherwise, on a CPU with AMX (`amx`, default: whether this one has it), prefill chunks over
        a bfloat16 cache go to torch's flash attention on AMX tiles (`amx_prefill_attention`)."""
        if deterministic:
            return AttentionKernels(decode=self.deterministic_decode_attention,
                                    prefill=functools.partial(self.prefill_attention, deterministic=True))
        amx = native_amx_bf16() if amx is None else amx
        prefill = functools.partial(amx_prefill_attention, self.prefill_attention) if amx else self.prefill_attention
        return AttentionKernels(decode=self.decode_attention, prefill=prefill)

    def model_ops(self, linear_dtype: torch.dtype = torch.float32, int8_activations: bool = False,
                  deterministic: bool = False) -> ModelOps:
        """The layer ops, with the linear layers' packed weights in `linear_dtype` (float32, or
        bfloat16 for bfloat16 mode), and the GGUF blocks' products with 8-bit activations where
        `int8_activations`; with `deterministic`, linears whose row bits do not depend on the
        batch (deterministic_ops.py)."""
        if deterministic:
            return deterministic_model_ops(self, linear_dtype, int8_activations)
        bf16 = linear_dtype == torch.bfloat16
        linear, logits = (self.bf16_linear, self.bf16_logits) if bf16 else (self.linear, self.logits)
        if int8_activations:
            linear = functools.partial(linear, int8_activations=True)
            logits = functools.partial(logits, int8_activations=True)
        return ModelOps(linear=linear, logits=logits, rms_norm=self.rms_norm, int8_activations=int8_activations,
                        add_rms_norm=self.add_rms_norm, rotary=self.rotary_embedding, silu_and_mul=self.silu_and_mul,
                        pack_linear_weight=functools.partial(self.pack_linear_weight, dtype=linear_dtype),
                        packed_replaces_float=bf16,
                        pack_interleaved_blocks=self._pack_interleaved if bf16 and not int8_activations else None,
                        decoder_layers=self.bf16_decoder_layers if bf16 else self.decoder_layers,
                        pack_logits_weight=functools.partial(self.pack_linear_weight, dtype=linear_dtype) if bf16 else None,
                        # from there `linear` takes oneDNN
                        decoder_layer_max_rows=(BF16_ONEDNN_MIN_ROWS if bf16 else ONEDNN_MIN_ROWS) - 1)

    def _pack_interleaved(self, blocks: BlockWeight) -> torch.Tensor | None:
        """bfloat16 mode's interleaved copy of `blocks` where the CPU runs its kernel
        (AVX512_BF16) and the weight has whole records of 16 features; else None (the file's
        blocks serve)."""
        if not self.bf16_dot_supported() or blocks.blocks.shape[0] % INTERLEAVED_FEATURES:
            return None
        return self.pack_interleaved_blocks(blocks.blocks, blocks.ggml_type)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               blocks: BlockWeight | None = None, packed: torch.Tensor | None = None, *,
               int8_activations: bool = False) -> torch.Tensor:
        """F.linear: by oneDNN on the `packed` weight for a float32 batch of ONEDNN_MIN_ROWS rows
        or more, else by the C++ kernel for one of at most SMALL_BATCH_MAX_ROWS rows (from
        `blocks` where the weight has them), else by MKL."""
        if packed is not None and x.dim() == 2 and x.shape[0] >= ONEDNN_MIN_ROWS and x.dtype == torch.float32:
            return self.onednn_linear(x, packed, bias)
        return self._linear_up_to(SMALL_BATCH_MAX_ROWS, x, weight, bias, blocks, int8_activations)

    def bf16_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    blocks: BlockWeight | None = None, packed: torch.Tensor | None = None, *,
                    int8_activations: bool = False) -> torch.Tensor:
        """F.linear in bfloat16 mode: by oneDNN on the bfloat16 `packed` weight for a batch of
        BF16_ONEDNN_MIN_ROWS rows or more, or of any size where the layer has no `blocks` (its
        float32 weight was dropped); else by `bf16_mode_block_linear` on the blocks."""
        if packed is not None and x.dim() == 2 and (blocks is None or x.shape[0] >= BF16_ONEDNN_MIN_ROWS):
            return self.onednn_bf16_linear(x, packed, bias)
        return self._bf16_blocks_or(SMALL_BATCH_MAX_ROWS, x, weight, bias, blocks, int8_activations)

    def logits(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               blocks: BlockWeight | None = None, packed: torch.Tensor | None = None, *,
               int8_activations: bool = False) -> torch.Tensor:
        """The LM head's F.linear, by the C++ kernel up to LOGITS_MAX_ROWS rows."""
        return self._linear_up_to(LOGITS_MAX_ROWS, x, weight, bias, blocks, int8_activations)

    def bf16_logits(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    blocks: BlockWeight | None = None, packed: torch.Tensor | None = None, *,
                    int8_activations: bool = False) -> torch.Tensor:
        """The LM head in bfloat16 mode: as the linear layers, by oneDNN's bfloat16 linear on the
        head's bfloat16 `packed` weight from BF16_ONEDNN_MIN_ROWS rows, else as `logits`."""
        if packed is not None and x.dim() == 2 and x.shape[0] >= BF16_ONEDNN_MIN_ROWS:
            return self.onednn_bf16_linear(x, packed, bias)
        return self._bf16_blocks_or(LOGITS_MAX_ROWS, x, weight, bias, blocks, int8_activations)

    def _bf16_blocks_or(self, max_rows: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        blocks: BlockWeight | None, int8_activations: bool) -> torch.Tensor:
        if blocks is not None and x.dim() == 2 and x.shape[0] < BF16_ONEDNN_MIN_ROWS and x.dtype == torch.float32:
            return self.bf16_mode_block_linear(x, blocks.blocks, blocks.ggml_type, bias, int8_activations,
                                               blocks.interleaved)
        return self._linear_up_to(max_rows, x, weight, bias, blocks, int8_activations)

    def _linear_up_to(self, max_rows: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      blocks: BlockWeight | None, int8_activations: bool = False) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= max_rows and x.dtype == torch.float32:
            if blocks is not None:
                return self.block_quantized_linear(x, blocks.blocks, blocks.ggml_type, bias, int8_activations)
            return self.small_batch_linear(x, weight, bias)
        return F.linear(x, weight, bias)


EXTENSION_NAME = "chunkserve_cpp_ops"


def build_directory() -> str:
    """Where the ops are compiled and cached: under the Python environment (its `share/`), so
    that checkouts with their own venvs never rebuild each other's ops, as they did in torch's
    per-user default (~/.cache/torch_extensions). Torch's own choice where TORCH_EXTENSIONS_DIR
    is set (it wins: benchmarks give each worktree one) or the environment is not writable (a
    system Python)."""
    if "TORCH_EXTENSIONS_DIR" in os.environ or not os.access(sys.prefix, os.W_OK):
        from torch.utils.cpp_extension import _get_build_directory

        return _get_build_directory(EXTENSION_NAME, verbose=False)
    # per torch version: a build against another torch's headers may not load
    path = os.path.join(sys.prefix, "share", "chunkserve", "torch_extensions", f"torch-{torch.__version__}")
    os.makedirs(path, exist_ok=True)
    return path


@contextlib.contextmanager
def exclusive_build(directory: str) -> Iterator[None]:
    """Hold the build directory while torch compiles or loads the ops there, and clear a lock
    file a killed build left behind.

    torch's own lock is a file that a build creates and deletes: a build killed in between
    (Ctrl-C, a timeout) leaves it, and every later start waits for it forever. Every start holds
    this `flock` around torch's build, and the kernel releases a flock when its holder dies, so
    a `lock` file found while holding it belongs to no live build."""
    with open(os.path.join(directory, "chunkserve.flock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = os.path.join(directory, "lock")
        if os.path.exists(stale):
            logger.warning("removing %s, left by a build of the C++ ops that was stopped before it finished", stale)
            os.remove(stale)
        yield


@functools.cache
def build_cpp_ops() -> CppOps:
    """Compile (or load the cached build of) the ops; raises if they cannot be built."""
    from torch.utils.cpp_extension import load

    try:  # the `ninja` wheel's binary, which is not on PATH unless the venv is activated
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    logger.info("loading the C++ ops (compiled on first use: about a minute)")
    directory = build_directory()
    with exclusive_build(directory):
        module = load(name=EXTENSION_NAME, sources=_SOURCES, extra_include_paths=[_CSRC],
                      extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"], extra_ldflags=["-fopenmp"],
                      build_directory=directory)
    return CppOps(decode_attention=module.paged_decode_attention, prefill_attention=module.paged_prefill_attention,
                  deterministic_decode_attention=module.deterministic_decode_attention,
                  small_batch_linear=module.small_batch_linear,
                  block_quantized_linear=module.block_quantized_linear,
                  rms_norm=module.rms_norm, add_rms_norm=module.add_rms_norm,
                  rotary_embedding=module.rotary_embedding, silu_and_mul=module.silu_and_mul,
                  onednn_linear=onednn_linear, onednn_bf16_linear=onednn_bf16_linear,
                  pack_linear_weight=pack_for_onednn,
                  # one C++ entry; each mode's set of kernels is named by its first argument (csrc/ops.h)
                  decoder_layers=functools.partial(module.decoder_layers, "float32"),
                  dequantized_linear=module.dequantized_linear, bf16_dot_linear=module.bf16_dot_linear,
                  bf16_mode_block_linear=module.bf16_mode_block_linear, round_to_bf16=module.round_to_bf16,
                  pack_interleaved_blocks=module.pack_interleaved_blocks,
                  interleaved_bf16_linear=module.interleaved_bf16_linear,
                  bf16_dot_supported=module.bf16_dot_supported,
                  deterministic_decoder_layers=functools.partial(module.decoder_layers, "deterministic_float32"),
                  bf16_decoder_layers=functools.partial(module.decoder_layers, "bfloat16"),
                  deterministic_bf16_decoder_layers=functools.partial(module.decoder_layers, "deterministic_bfloat16"),
                  cpu_has_vnni=module.cpu_has_vnni, cpu_isa=module.cpu_isa,
                  set_cpu_isa=module.set_cpu_isa)


def model_ops_for(cpp_ops: CppOps | None, linear_dtype: torch.dtype, int8_activations: bool = False,
                  deterministic: bool = False) -> ModelOps:
    """The layer ops a model computes with: the C++ ones, or plain torch where `cpp_ops` is None,
    for float32 or bfloat16 linear layers (`LlamaModel.compute_dtype`), with 8-bit activations
    for the GGUF blocks where `int8_activations` (C++ only), batch-invariant where
    `deterministic` (C++ only)."""
    if cpp_ops is None:
        if deterministic:
            raise InvalidRequestError("--deterministic runs in the C++ ops, which are off here (--op-backend torch, "
                                      "or they could not be built): use --op-backend cpp", param="deterministic")
        if int8_activations:
            raise InvalidRequestError("--int8-activations runs in the C++ ops, which are off here (--op-backend torch, "
                                      "or they could not be built): leave the flag off or use --op-backend cpp",
                                      param="int8_activations")
        return torch_ops(linear_dtype)
    return cpp_ops.model_ops(linear_dtype, int8_activations, deterministic)


def cpp_ops_for(backend: str) -> CppOps | None:
    """The ops for `backend`: "cpp" must build, "auto" falls back to None (torch) with a
    warning, "torch" is always None."""
    if backend not in OP_BACKENDS:
        raise ValueError(f"op backend must be one of {OP_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return None
    try:
        return build_cpp_ops()
    except Exception as error:  # no compiler, no ninja, a failed build
        if backend == "cpp":
            raise
        logger.warning("the C++ ops could not be built (%s); using plain torch", error)
        return None


def build_report() -> str:
    """Build the ops now (as `make install` does) and say whether it worked; never raises."""
    try:
        build_cpp_ops()
        return "the C++ ops are built"
    except Exception as error:  # reported, not fatal: the engine falls back to plain torch
        return f"the C++ ops are not available here ({error}); plain torch will serve"

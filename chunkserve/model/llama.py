"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over a flat mixed batch.

Every linear layer runs once over all T rows of the step (prefill chunks and decodes
together: SARATHI's piggybacking); only attention looks at request boundaries. Q/K/V and
gate/up are fused into one matmul each when the weights are loaded, each residual add into
the norm that follows it, and the arithmetic goes through `ModelOps` (model/ops.py), which
the worker may swap for its C++ ops.

Split over ranks (`ParallelContext`, vLLM's sharding): tensor parallelism gives each rank
its share of the attention heads and of the MLP's intermediate rows, the layers ending in a
row-parallel matmul (o_proj, down_proj) summing their partial outputs with one all-reduce,
and the LM head its share of the vocabulary; pipeline parallelism gives each stage a run of
layers, the first stage the embedding and the last the final norm and the LM head.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from chunkserve.attention.paged import AttentionMetadata, DecodeGroup, paged_attention, write_kv
from chunkserve.errors import ModelLoadError
from chunkserve.model.config import ModelConfig
from chunkserve.model.parallel import ParallelContext, block_columns, block_rows
from chunkserve.ops.model_ops import TORCH_OPS, BlockWeight, ModelOps


class UsesOps:
    """A module that computes through the model's `ModelOps` (set by `LlamaModel.set_ops`)."""

    ops: ModelOps = TORCH_OPS


class Linear(nn.Linear, UsesOps):
    blocks: BlockWeight | None = None  # the weight as GGUF blocks, where it was loaded from them
    packed: torch.Tensor | None = None  # the weight in the ops' preferred layout (set with the ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(x, self.weight, self.bias, self.blocks, self.packed)


class RMSNorm(nn.Module, UsesOps):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused with the next norm."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (the Hugging Face `rotate_half` layout).

    M-RoPE (Qwen2-VL, `mrope_section`): positions are [3, T] (temporal, height, width) and each
    frequency rotates by the position on its own axis, the frequencies split into sections of
    t, h, w in turn, as transformers' `apply_multimodal_rotary_pos_emb` splits them (its tables
    repeat over both halves of head_dim; ours hold one half, which the rotary op takes)."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        # Plain attributes, not buffers: the model is built on the meta device and the
        # tables are computed here, on the CPU, whatever the surrounding device context.
        inv_freq, scaling = config.rotary_inv_freq()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq)
        self.cos = freqs.cos() * scaling  # [max_positions, head_dim // 2]
        self.sin = freqs.sin() * scaling
        self.mrope_axis = _mrope_axis(config)  # [head_dim // 2]: each frequency's axis (0 t, 1 h, 2 w), or None

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim // 2] at `positions` [T] (or M-RoPE's [3, T]): looked up once per
        step, used by every layer."""
        if positions.dim() == 1:
            return self.cos[positions].to(dtype), self.sin[positions].to(dtype)
        rows = positions[self.mrope_axis].T  # [T, head_dim // 2]: each frequency's position
        columns = torch.arange(rows.shape[1])
        return self.cos[rows, columns].to(dtype), self.sin[rows, columns].to(dtype)


def _mrope_axis(config: ModelConfig) -> torch.Tensor | None:
    section = config.multimodal.mrope_section if config.multimodal is not None else None
    if section is None:
        return None
    if sum(section) != config.head_dim // 2:
        raise ModelLoadError(f"mrope_section {list(section)} must add up to head_dim / 2 ({config.head_dim // 2})")
    axes = torch.arange(len(section), device="cpu") % 3
    return torch.repeat_interleave(axes, torch.tensor(section, device="cpu"))


class Attention(nn.Module, UsesOps):
    """This rank's heads: q/k/v column-parallel (the rows of its q, k and v heads, fused), o_proj
    row-parallel (the input columns of its q heads)."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext) -> None:
        super().__init__()
        self.parallel = parallel
        self.num_heads = len(parallel.shard_range(config.num_heads))
        self.num_kv_heads = len(parallel.kv_head_range(config.num_kv_heads))
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.scale = self.head_dim**-0.5

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        num_rows = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_rows, self.num_heads, self.head_dim)
        k = k.view(num_rows, self.num_kv_heads, self.head_dim)
        v = v.view(num_rows, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.ops.rotary(q, k, *rotary)
        k_cache, v_cache = kv_cache
        write_kv(k_cache, v_cache, k, v, meta)
        out = paged_attention(q, k_cache, v_cache, meta, self.scale)
        return self.parallel.all_reduce(self.o_proj(out.view(num_rows, self.q_size)))


class MLP(nn.Module, UsesOps):
    """This rank's intermediate rows: gate_up column-parallel, down_proj row-parallel."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext) -> None:
        super().__init__()
        self.parallel = parallel
        intermediate = config.intermediate_size // parallel.tp_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parallel.all_reduce(self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x))))


@dataclass
class FusedLayers:
    """Consecutive decoder layers as `ModelOps.decoder_layers` takes them (csrc/ops.h): one layer's
    (`DecoderLayer.fuse_for_decode`) or a whole stage's (`stack`), for pure decode steps."""

    weights: list[torch.Tensor]  # qkv, o, gate_up, down of each layer in turn: GGUF blocks or float32 weights
    types: list[int]  # their ggml types, -1 for a float32 weight
    interleaved: list[torch.Tensor | None]  # their blocks' `BlockWeight.interleaved`, where they have it
    qkv_biases: list[torch.Tensor | None]
    input_norms: list[torch.Tensor]
    post_attention_norms: list[torch.Tensor]
    eps: float
    num_heads: int
    num_kv_heads: int
    scale: float

    @classmethod
    def stack(cls, layers: list[FusedLayers | None]) -> FusedLayers | None:
        """The layers in one call, or None where one of them cannot be fused (or there are none)."""
        if not layers or any(layer is None for layer in layers):
            return None
        first = layers[0]
        return cls(weights=[w for layer in layers for w in layer.weights],
                   types=[t for layer in layers for t in layer.types],
                   interleaved=[w for layer in layers for w in layer.interleaved],
                   qkv_biases=[b for layer in layers for b in layer.qkv_biases],
                   input_norms=[n for layer in layers for n in layer.input_norms],
                   post_attention_norms=[n for layer in layers for n in layer.post_attention_norms],
                   eps=first.eps, num_heads=first.num_heads, num_kv_heads=first.num_kv_heads, scale=first.scale)

    @staticmethod
    def decode_group(ops: ModelOps, hidden: torch.Tensor, meta: AttentionMetadata) -> DecodeGroup | None:
        """The step's decode group where `decoder_layers` computes this step (a pure decode step
        of few enough float32 rows), else None."""
        if hidden.shape[0] > ops.decoder_layer_max_rows or hidden.dtype != torch.float32:
            return None
        return meta.in_place_decode_group()

    def __call__(self, ops: ModelOps, hidden: torch.Tensor, residual: torch.Tensor | None,
                 rotary: tuple[torch.Tensor, torch.Tensor], kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 meta: AttentionMetadata, group: DecodeGroup) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.decoder_layers(
            hidden, residual, *rotary, [k for k, _ in kv_caches], [v for _, v in kv_caches], meta.slot_mapping,
            group.block_tables, group.context_lens, meta.block_size, self.weights, self.types, self.interleaved,
            self.qkv_biases, self.input_norms, self.post_attention_norms, self.eps, self.num_heads, self.num_kv_heads,
            self.scale, ops.int8_activations)


class DecoderLayer(nn.Module, UsesOps):
    def __init__(self, config: ModelConfig, parallel: ParallelContext) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, parallel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, parallel)
        # this layer's part of `ModelOps.decoder_layers`' arguments, where it can run this layer
        self.fused: FusedLayers | None = None

    def fuse_for_decode(self) -> None:
        """Let pure decode steps run this layer through `ops.decoder_layers` (one call): where the
        ops have it and the layer is what it computes (one TP rank, no q/k norms, float32 or GGUF
        block weights: not a bfloat16-mode layer whose only weight is the packed one). Call after
        the weights are loaded and packed."""
        attention, mlp = self.self_attn, self.mlp
        linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
        fusable = (self.ops.decoder_layers is not None and attention.parallel.tp_size == 1
                   and attention.q_norm is None
                   and all(layer.blocks is not None or (layer.weight.dtype == torch.float32 and not layer.weight.is_meta)
                           for layer in linears))
        if not fusable:
            self.fused = None
            return
        self.fused = FusedLayers(
            weights=[layer.weight if layer.blocks is None else layer.blocks.blocks for layer in linears],
            types=[-1 if layer.blocks is None else layer.blocks.ggml_type for layer in linears],
            interleaved=[None if layer.blocks is None else layer.blocks.interleaved for layer in linears],
            qkv_biases=[attention.qkv_proj.bias], input_norms=[self.input_layernorm.weight],
            post_attention_norms=[self.post_attention_layernorm.weight], eps=self.input_layernorm.eps,
            num_heads=attention.num_heads, num_kv_heads=attention.num_kv_heads, scale=attention.scale)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rotary: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """`residual` is the stream so far and `hidden` the last sublayer's output to add to it
        (at the first layer: the embeddings, residual None). Returns the MLP's output and the
        stream before it; the caller's next norm adds them."""
        group = None if self.fused is None else self.fused.decode_group(self.ops, hidden, meta)
        if group is not None:
            return self.fused(self.ops, hidden, residual, rotary, [kv_cache], meta, group)
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm.add_forward(hidden, residual)
        hidden = self.self_attn(hidden, rotary, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm.add_forward(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module, UsesOps):
    """This rank's part of the model: its stage's layers (`parallel.layers`, indexed locally
    from 0), sharded over its TP ranks. Modules the stage does not run are None."""

    def __init__(self, config: ModelConfig, max_positions: int, parallel: ParallelContext | None = None) -> None:
        super().__init__()
        parallel = parallel or ParallelContext.single()
        self.config, self.parallel = config, parallel
        self.layer_range = range(config.num_layers) if parallel.layers is None else parallel.layers  # global indices
        first, last, tied = parallel.is_first_stage, parallel.is_last_stage, config.tie_word_embeddings
        self.vocab_rows = parallel.vocab_shard(config.vocab_size)  # the LM head's rows on this rank
        self.vocab_shard_size = -(-config.vocab_size // parallel.tp_size)  # every shard's logits, padded
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if first else None
        self.rotary = RotaryEmbedding(config, max_positions)
        self.layers = nn.ModuleList(DecoderLayer(config, parallel) for _ in self.layer_range)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if last else None
        # A tied head on the first stage reads its rows of the embedding table; elsewhere the
        # last stage holds its head rows (the embedding's, when tied) as a Linear.
        own_head = last and not (tied and first)
        self.lm_head = Linear(config.hidden_size, len(self.vocab_rows), bias=False) if own_head else None
        self.embedding_blocks: BlockWeight | None = None  # the GGUF blocks of a head read from the embedding table
        # --dtype: the dtype of the KV cache and of the linear layers' packed weights and products
        # (bfloat16 mode); the parameters, the residual stream, norms, rotary and logits are float32
        self.compute_dtype = torch.float32
        # --int8-activations: the GGUF block linears (and head) take activations quantized to 8 bits
        self.int8_activations = False
        self.head_packed: torch.Tensor | None = None  # the head's weight as `ModelOps.pack_logits_weight` made it
        self.fused_layers: FusedLayers | None = None  # every layer in one `decoder_layers` call, where all can be
        self.requires_grad_(False)

    def set_ops(self, ops: ModelOps) -> None:
        """Compute every layer (and the LM head) through `ops`; call it once, after the weights
        are loaded, since the layers' weights are packed for `ops` here. A layer with both a
        packed weight and GGUF blocks never reads its float32 weight again (`ModelOps.linear`
        takes the packed one from ONEDNN_MIN_ROWS rows, the blocks below), so that copy is
        dropped: it is a third of a GGUF model's resident memory; so is every packed layer's
        where the ops read the packed weight alone (`packed_replaces_float`: bfloat16 mode).
        What is left in its place is a meta tensor of the same shape, which fails loudly if
        anything still reads it."""
        for module in self.modules():
            if isinstance(module, UsesOps):
                module.ops = ops
            if isinstance(module, Linear):
                module.blocks = _with_interleaved(ops, module.blocks)
            if isinstance(module, Linear) and module is not self.lm_head:  # the head goes through ops.logits
                module.packed = ops.pack_linear_weight(module.weight)
                if module.packed is not None and (module.blocks is not None or ops.packed_replaces_float):
                    module.weight = nn.Parameter(module.weight.to("meta"), requires_grad=False)
        self.embedding_blocks = _with_interleaved(ops, self.embedding_blocks)
        for layer in self.layers:
            layer.fuse_for_decode()
        self.fused_layers = FusedLayers.stack([layer.fused for layer in self.layers])
        self.head_packed = None
        if self.parallel.is_last_stage and ops.pack_logits_weight is not None:
            self.head_packed = ops.pack_logits_weight(self._head()[0])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                input_embeds: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """input_ids: [T]; positions: [T] ([3, T] for M-RoPE); `kv_caches` one per layer of this
        stage. The first stage starts from `input_embeds` [T, hidden] float32 where given (a
        vision-language model's rows with image embeddings in them), else from the embeddings of
        input_ids; a later stage from the previous stage's `intermediate` (hidden, residual). The
        last stage returns the final hidden states [T, hidden]; the others (hidden, residual),
        each [T, hidden], for the next stage."""
        if self.parallel.is_first_stage:
            hidden = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
            residual = None
        else:
            hidden, residual = intermediate
        rotary = self.rotary(positions, hidden.dtype)
        connector = meta.kv_connector
        fused = self.fused_layers
        group = None if fused is None or connector is not None else fused.decode_group(self.ops, hidden, meta)
        if group is not None:
            hidden, residual = fused(self.ops, hidden, residual, rotary, kv_caches, meta, group)
            return self._stage_output(hidden, residual)
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if connector is not None:
                connector.wait_for_layer_load(index)
            hidden, residual = layer(hidden, residual, rotary, kv_cache, meta)
            if connector is not None:
                connector.save_kv_layer(index, *kv_cache, meta)
        return self._stage_output(hidden, residual)

    def _stage_output(self, hidden: torch.Tensor, residual: torch.Tensor
                      ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The last stage's final hidden states; another stage's (hidden, residual) for the next."""
        if not self.parallel.is_last_stage:
            return hidden.contiguous(), residual.contiguous()
        return self.norm.add_forward(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[R, hidden] -> float32 logits [R, vocab] on the first TP rank, None on the others
        (each computes its vocabulary shard, the first gathers them); called on the last stage
        only, for rows that sample."""
        weight, blocks = self._head()
        shard = self.ops.logits(hidden, weight, None, blocks, self.head_packed)
        if shard.shape[1] < self.vocab_shard_size:  # the last shard: zero columns, cut after the gather
            shard = F.pad(shard, (0, self.vocab_shard_size - shard.shape[1]))
        logits = self.parallel.gather_vocab(shard, self.config.vocab_size)
        return None if logits is None else logits.float()

    def _head(self) -> tuple[torch.Tensor, BlockWeight | None]:
        """The LM head's weight (this rank's vocabulary rows) and its GGUF blocks, if any."""
        if self.lm_head is None:
            rows = self.vocab_rows
            return self.embed_tokens.weight[rows.start : rows.stop], self.embedding_blocks
        return self.lm_head.weight, self.lm_head.blocks

    def has_block_weights(self) -> bool:
        """Whether any linear (or the tied head) reads GGUF blocks, the weights `int8_activations` is for."""
        return self.embedding_blocks is not None or any(
            isinstance(module, Linear) and module.blocks is not None for module in self.modules())

    def uses_weight(self, name: str) -> bool:
        """Whether this rank reads checkpoint tensor `name` (Hugging Face naming), so that the
        loader can skip the others' layers."""
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) in self.layer_range
        if name == "model.embed_tokens.weight":
            return self.embed_tokens is not None or (self.parallel.is_last_stage and self.config.tie_word_embeddings)
        return self.parallel.is_last_stage  # the final norm, the LM head

    def load_hf_weights(self, weights: dict[str, torch.Tensor], blocks: dict[str, BlockWeight] | None = None) -> None:
        """Take this rank's slices of Hugging Face-named tensors, fusing q/k/v and gate/up;
        `blocks` holds the GGUF blocks of the weights that came as such, under the same
        names. Only this stage's layers are read."""
        config, parallel = self.config, self.parallel
        source = _HFWeights(self, weights, blocks or {})
        embedding = "model.embed_tokens.weight"
        if self.embed_tokens is not None:
            source.put("embed_tokens.weight", source.take(embedding))
        if parallel.is_last_stage:
            source.put("norm.weight", source.take("model.norm.weight"))
            if self.lm_head is None:
                self.embedding_blocks = block_rows(source.blocks.get(embedding), self.vocab_rows)
            else:
                head = embedding if config.tie_word_embeddings else "lm_head.weight"
                source.put_column_parallel(self.lm_head, "lm_head", [(head, self.vocab_rows)])
        for local, index in enumerate(self.layer_range):
            self._load_layer(source, index, local)
        assert not source.unloaded, f"weights not loaded: {sorted(source.unloaded)}"

    def _load_layer(self, source: _HFWeights, index: int, local: int) -> None:
        """Checkpoint layer `index` into this stage's layer `local`: this rank's heads of q/k/v
        and o, its share of the MLP, and the norms whole."""
        config, parallel = self.config, self.parallel
        q_rows = _head_rows(parallel.shard_range(config.num_heads), config.head_dim)
        kv_rows = _head_rows(parallel.kv_head_range(config.num_kv_heads), config.head_dim)
        mlp_rows = parallel.shard_range(config.intermediate_size)
        src, dst, layer = f"model.layers.{index}.", f"layers.{local}.", self.layers[local]
        qkv_rows = list(zip((f"{src}self_attn.{p}_proj" for p in "qkv"), (q_rows, kv_rows, kv_rows)))
        source.put_column_parallel(layer.self_attn.qkv_proj, f"{dst}self_attn.qkv_proj",
                                   [(f"{part}.weight", rows) for part, rows in qkv_rows])
        if config.qkv_bias:
            bias = [source.take(f"{part}.bias")[rows.start : rows.stop] for part, rows in qkv_rows]
            source.put(f"{dst}self_attn.qkv_proj.bias", torch.cat(bias))
        source.put_row_parallel(layer.self_attn.o_proj, f"{dst}self_attn.o_proj", f"{src}self_attn.o_proj.weight",
                                q_rows)
        source.put_column_parallel(layer.mlp.gate_up_proj, f"{dst}mlp.gate_up_proj",
                                   [(f"{src}mlp.{p}_proj.weight", mlp_rows) for p in ("gate", "up")])
        source.put_row_parallel(layer.mlp.down_proj, f"{dst}mlp.down_proj", f"{src}mlp.down_proj.weight", mlp_rows)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            source.put(f"{dst}{norm}.weight", source.take(f"{src}{norm}.weight"))
        if config.qk_norm:
            for norm in ("q_norm", "k_norm"):
                source.put(f"{dst}self_attn.{norm}.weight", source.take(f"{src}self_attn.{norm}.weight"))


def _with_interleaved(ops: ModelOps, blocks: BlockWeight | None) -> BlockWeight | None:
    """`blocks` with their copy interleaved for `ops`' decode kernel beside the file's, where the ops have one."""
    if blocks is None or ops.pack_interleaved_blocks is None:
        return blocks
    return dataclasses.replace(blocks, interleaved=ops.pack_interleaved_blocks(blocks))


def _head_rows(heads: range, head_dim: int) -> range:
    """The weight rows of attention heads `heads`."""
    return range(heads.start * head_dim, heads.stop * head_dim)


class _HFWeights:
    """Hugging Face-named tensors (and their GGUF blocks) copied into a model's parameters, each
    parameter once: those left in `unloaded` at the end had no tensor."""

    def __init__(self, model: nn.Module, weights: dict[str, torch.Tensor], blocks: dict[str, BlockWeight]) -> None:
        self.weights, self.blocks = weights, blocks
        self.dtype = next(model.parameters()).dtype
        self.unloaded = dict(model.named_parameters())

    def take(self, name: str) -> torch.Tensor:
        if name not in self.weights:
            raise KeyError(f"weight {name!r} is missing from the checkpoint")
        return self.weights[name]

    def put(self, name: str, tensor: torch.Tensor) -> None:
        target = self.unloaded.pop(name)
        assert target.shape == tensor.shape, f"{name}: expected {tuple(target.shape)}, got {tuple(tensor.shape)}"
        target.copy_(tensor.to(self.dtype))

    def put_column_parallel(self, layer: Linear, name: str, parts: list[tuple[str, range]]) -> None:
        """Rows `rows` of each part, one part after another."""
        self.put(f"{name}.weight", torch.cat([self.take(part)[rows.start : rows.stop] for part, rows in parts]))
        layer.blocks = BlockWeight.stack([block_rows(self.blocks.get(part), rows) for part, rows in parts])

    def put_row_parallel(self, layer: Linear, name: str, part: str, columns: range) -> None:
        weight = self.take(part)
        self.put(f"{name}.weight", weight[:, columns.start : columns.stop])
        layer.blocks = block_columns(self.blocks.get(part), weight.shape[1], columns)

"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over a flat mixed batch.

Every linear layer runs once over all T rows of the step (prefill chunks and decodes
together: SARATHI's piggybacking); only attention looks at request boundaries. Q/K/V and
gate/up are fused into one matmul each when the weights are loaded, each residual add into
the norm that follows it, and the arithmetic goes through `ModelOps` (model/ops.py), which
the worker may swap for its C++ ops.
"""

from __future__ import annotations

import torch
from torch import nn

from chunkserve.attention.paged import AttentionMetadata, paged_attention, write_kv
from chunkserve.model.config import ModelConfig
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
    """Neox-style rotary embedding (the Hugging Face `rotate_half` layout)."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        # Plain attributes, not buffers: the model is built on the meta device and the
        # tables are computed here, on the CPU, whatever the surrounding device context.
        inv_freq, scaling = config.rotary_inv_freq()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq)
        self.cos = freqs.cos() * scaling  # [max_positions, head_dim // 2]
        self.sin = freqs.sin() * scaling

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim // 2] at `positions` [T]: looked up once per step, used by every layer."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


class Attention(nn.Module, UsesOps):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
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
        return self.o_proj(out.view(num_rows, self.q_size))


class MLP(nn.Module, UsesOps):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, rotary: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """`residual` is the stream so far and `hidden` the last sublayer's output to add to it
        (at the first layer: the embeddings, residual None). Returns the MLP's output and the
        stream before it; the caller's next norm adds them."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm.add_forward(hidden, residual)
        hidden = self.self_attn(hidden, rotary, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm.add_forward(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module, UsesOps):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config, max_positions)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, bias=False)
        self.embedding_blocks: BlockWeight | None = None  # the tied LM head's GGUF blocks
        self.requires_grad_(False)

    def set_ops(self, ops: ModelOps) -> None:
        """Compute every layer (and the LM head) through `ops`; call it after the weights are
        loaded, since the layers' weights are packed for `ops` here."""
        for module in self.modules():
            if isinstance(module, UsesOps):
                module.ops = ops
            if isinstance(module, Linear) and module is not self.lm_head:  # the head goes through ops.logits
                module.packed = ops.pack_linear_weight(module.weight)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""
        hidden, residual = self.embed_tokens(input_ids), None
        rotary = self.rotary(positions, hidden.dtype)
        connector = meta.kv_connector
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if connector is not None:
                connector.wait_for_layer_load(index)
            hidden, residual = layer(hidden, residual, rotary, kv_cache, meta)
            if connector is not None:
                connector.save_kv_layer(index, *kv_cache, meta)
        return self.norm.add_forward(hidden, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, hidden] -> float32 logits [R, vocab]; called only for rows that sample."""
        if self.lm_head is None:
            return self.ops.logits(hidden, self.embed_tokens.weight, None, self.embedding_blocks).float()
        return self.ops.logits(hidden, self.lm_head.weight, None, self.lm_head.blocks).float()

    def load_hf_weights(self, weights: dict[str, torch.Tensor], blocks: dict[str, BlockWeight] | None = None) -> None:
        """Take Hugging Face-named tensors, fusing q/k/v and gate/up; `blocks` holds the GGUF
        blocks of the weights that came as such, under the same names."""
        blocks = blocks or {}
        dtype = self.embed_tokens.weight.dtype
        own = dict(self.named_parameters())

        def put(name: str, tensor: torch.Tensor) -> None:
            target = own.pop(name)
            assert target.shape == tensor.shape, f"{name}: expected {tuple(target.shape)}, got {tuple(tensor.shape)}"
            target.copy_(tensor.to(dtype))

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"weight {name!r} is missing from the checkpoint")
            return weights[name]

        def put_linear(layer: Linear, name: str, parts: list[str]) -> None:
            put(f"{name}.weight", torch.cat([take(part) for part in parts]))
            layer.blocks = BlockWeight.stack([blocks.get(part) for part in parts])

        put("embed_tokens.weight", take("model.embed_tokens.weight"))
        self.embedding_blocks = blocks.get("model.embed_tokens.weight")
        put("norm.weight", take("model.norm.weight"))
        if self.lm_head is not None:
            put_linear(self.lm_head, "lm_head", ["lm_head.weight"])
        for i in range(self.config.num_layers):
            src, dst, layer = f"model.layers.{i}.", f"layers.{i}.", self.layers[i]
            put_linear(layer.self_attn.qkv_proj, f"{dst}self_attn.qkv_proj",
                       [f"{src}self_attn.{p}_proj.weight" for p in "qkv"])
            if self.config.qkv_bias:
                bias = [take(f"{src}self_attn.{p}_proj.bias") for p in "qkv"]
                put(f"{dst}self_attn.qkv_proj.bias", torch.cat(bias))
            put_linear(layer.self_attn.o_proj, f"{dst}self_attn.o_proj", [f"{src}self_attn.o_proj.weight"])
            put_linear(layer.mlp.gate_up_proj, f"{dst}mlp.gate_up_proj",
                       [f"{src}mlp.{p}_proj.weight" for p in ("gate", "up")])
            put_linear(layer.mlp.down_proj, f"{dst}mlp.down_proj", [f"{src}mlp.down_proj.weight"])
            for norm in ("input_layernorm", "post_attention_layernorm"):
                put(f"{dst}{norm}.weight", take(f"{src}{norm}.weight"))
            if self.config.qk_norm:
                for norm in ("q_norm", "k_norm"):
                    put(f"{dst}self_attn.{norm}.weight", take(f"{src}self_attn.{norm}.weight"))
        assert not own, f"weights not loaded: {sorted(own)}"

"""Speculative decoding's draft model: a second model of the same tokenizer that proposes the
tokens the target model then verifies.

Its KV pool has the target's blocks (the same block ids and tables, its own layers and heads),
so it needs no bookkeeping of its own: every step it runs the target's rows first (prompt
chunks, decodes, drafts), which keeps its KV at every computed position in step with the
target's, then proposes greedily, one row per request and draft: the token the step just
sampled, then each draft it proposes. Those proposal rows write KV past the verified tokens,
in slots the scheduler allocated ahead for them; the next step's rows overwrite them. A block
found in the prefix cache was computed by such steps too, so its draft KV is there as well (a
block that came from elsewhere, a snapshot or a KV tier, holds no draft KV: drafts then fail
more often, but verification keeps every output the target's own).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np
import torch

from chunkserve.core.messages import ScheduledRequest
from chunkserve.model.config import ModelConfig
from chunkserve.model.llama import LlamaModel
from chunkserve.ops.cpp_ops import AttentionKernels, CppOps, model_ops_for
from chunkserve.worker.input_batch import ForwardBatch, build_forward_batch
from chunkserve.worker.kv_cache import allocate_kv_pool, layer_caches


class DraftModelProposer:
    def __init__(self, model: LlamaModel, config: ModelConfig, target_vocab_size: int, max_model_len: int) -> None:
        self.model = model
        self.config = config
        self.vocab_size = min(config.vocab_size, target_vocab_size)  # proposals are target token ids
        self.max_model_len = max_model_len
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = 0
        self.kernels: AttentionKernels | None = None
        self.deterministic = False  # the target's mode: its drafts are then the same in any batch

    def bind(self, num_blocks: int, block_size: int, cpp_ops: CppOps | None, kernels: AttentionKernels | None,
             deterministic: bool = False) -> None:
        """Allocate its KV pool over the target's block ids, and use the target's ops and mode."""
        self.kv_caches = layer_caches(allocate_kv_pool(self.config, self.model.compute_dtype, num_blocks, block_size))
        self.block_size = block_size
        self.kernels = kernels
        self.deterministic = deterministic
        self.model.set_ops(model_ops_for(cpp_ops, self.model.compute_dtype, deterministic=deterministic))

    def propose(self, batch: ForwardBatch, scheduled: list[ScheduledRequest], token_ids: Mapping[str, list[int]],
                tables: Mapping[str, np.ndarray], sampled: Mapping[str, list[int]]) -> dict[str, list[int]]:
        """The step's rows through the draft model, then `num_draft_proposals` greedy drafts for
        each request that asked and sampled (`sampled`: its accepted tokens of this step)."""
        self.model(batch.input_ids, batch.positions, self.kv_caches, dataclasses.replace(batch.attn, kv_connector=None))
        sequences: dict[str, list[int]] = {}  # each proposing request's tokens: known, accepted, drafted
        wanted: dict[str, int] = {}
        for s in scheduled:
            run = sampled.get(s.request_id)
            if not s.num_draft_proposals or not run:
                continue
            known = s.num_computed_tokens + s.num_scheduled_tokens - len(s.draft_token_ids)
            sequence = token_ids[s.request_id][:known] + run
            count = min(s.num_draft_proposals, self.max_model_len - len(sequence))
            if count > 0:
                sequences[s.request_id], wanted[s.request_id] = sequence, count
        drafts: dict[str, list[int]] = {request_id: [] for request_id in sequences}
        for index in range(max(wanted.values(), default=0)):
            active = [request_id for request_id, count in wanted.items() if count > index]
            rows = [ScheduledRequest(request_id, len(sequences[request_id]) - 1, 1, [], False, True, True)
                    for request_id in active]
            step = build_forward_batch(rows, sequences, tables, self.block_size, self.kernels)
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.attn)
            tokens = self.model.compute_logits(hidden[step.logits_indices])[:, : self.vocab_size].argmax(dim=-1)
            for request_id, token in zip(step.sample_request_ids, tokens.tolist()):
                drafts[request_id].append(token)
                sequences[request_id].append(token)
        return drafts

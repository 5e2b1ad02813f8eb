"""Drive a model directly over a paged KV cache, as the runner would, for logit checks."""

from __future__ import annotations

import numpy as np
import torch

from chunkserve.core.messages import ScheduledRequest
from chunkserve.ops.cpp_ops import model_ops_for
from chunkserve.worker.input_batch import build_forward_batch
from chunkserve.worker.kv_cache import allocate_kv_cache

BLOCK_SIZE = 16


class PagedRunner:
    """Drives the model over a paged cache with deliberately scattered block tables."""

    def __init__(self, model, config, num_blocks: int = 256, cpp_ops=None, deterministic: bool = False) -> None:
        """`cpp_ops`: compute through the C++ ops (None: plain torch); `deterministic`: their
        batch-invariant linears."""
        self.attention_kernels = None if cpp_ops is None else cpp_ops.attention_kernels()
        model.set_ops(model_ops_for(cpp_ops, model.compute_dtype, model.int8_activations, deterministic))
        self.model, self.kv = model, allocate_kv_cache(config, model.compute_dtype, num_blocks, BLOCK_SIZE)
        self.free = list(np.random.default_rng(0).permutation(num_blocks))
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def add(self, request_id: str, token_ids: list[int]) -> None:
        self.tokens[request_id], self.computed[request_id], self.tables[request_id] = list(token_ids), 0, []

    def step(self, work: dict[str, int]) -> dict[str, torch.Tensor]:
        """Run `work[request_id]` tokens of each request in one forward; logits of every row."""
        scheduled = []
        for request_id, count in work.items():
            start = self.computed[request_id]
            table = self.tables[request_id]
            while len(table) * BLOCK_SIZE < start + count:
                table.append(int(self.free.pop()))
            scheduled.append(ScheduledRequest(request_id, start, count, [], False, True, count == 1 and start > 0))
            self.computed[request_id] += count
        tables = {request_id: np.asarray(self.tables[request_id], dtype=np.int64) for request_id in work}
        batch = build_forward_batch(scheduled, self.tokens, tables, BLOCK_SIZE, self.attention_kernels)
        with torch.inference_mode():
            logits = self.model.compute_logits(self.model(batch.input_ids, batch.positions, self.kv, batch.attn))
        rows, row = {}, 0
        ordered = [s for s in scheduled if s.num_scheduled_tokens == 1] + [s for s in scheduled if s.num_scheduled_tokens > 1]
        for s in ordered:
            rows[s.request_id] = logits[row : row + s.num_scheduled_tokens]
            row += s.num_scheduled_tokens
        return rows


def tables_of(scheduled: list[ScheduledRequest]) -> dict[str, np.ndarray]:
    """Each request's block table, for steps whose `new_block_ids` hold the whole table."""
    return {s.request_id: np.asarray(s.new_block_ids, dtype=np.int64) for s in scheduled}


def reference_logits(reference, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return reference(torch.tensor([token_ids])).logits[0]

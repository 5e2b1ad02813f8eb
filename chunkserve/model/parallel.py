"""A rank's place in the model split and the collectives the model calls, over
torch.distributed (gloo on CPU). One `ParallelContext` per worker; the single-process one
(`ParallelContext.single()`) makes every collective a no-op, so the same model code serves.

Every collective is timed and its bytes counted (`CommStats`): the step trace and /metrics
report communication per step and rank from them."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from chunkserve.config.parallel import ParallelConfig
from chunkserve.model.config import ModelConfig
from chunkserve.ops.model_ops import BlockWeight

GGUF_BLOCK_WEIGHTS = 32  # weights per GGUF block (Q4_0, Q4_1, Q8_0)


@dataclass
class CommStats:
    """Collectives since the last `take()`: how many, their payload bytes, their seconds, and
    of those the pipeline's sends and receives (mostly waiting for the other stage)."""

    count: int = 0
    bytes: int = 0
    seconds: float = 0.0
    p2p_seconds: float = 0.0

    def add(self, nbytes: int, seconds: float, p2p: bool = False) -> None:
        self.count += 1
        self.bytes += nbytes
        self.seconds += seconds
        if p2p:
            self.p2p_seconds += seconds

    def take(self) -> CommStats:
        taken = CommStats(self.count, self.bytes, self.seconds, self.p2p_seconds)
        self.count, self.bytes, self.seconds, self.p2p_seconds = 0, 0, 0.0, 0.0
        return taken


@dataclass
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    layers: range | None = None  # this stage's layers; None: all
    tp_group: object = None  # the torch.distributed group of this stage's TP ranks
    tp_ranks: tuple[int, ...] = (0,)  # their global ranks, tp_rank order
    prev_rank: int | None = None  # the previous stage's rank with this tp_rank (PP)
    next_rank: int | None = None
    fixed_order_reduce: bool = False  # deterministic mode: `all_reduce` sums in rank order
    stats: CommStats = field(default_factory=CommStats)

    @staticmethod
    def single() -> ParallelContext:
        return ParallelContext()

    @staticmethod
    def from_world(rank: int, split: ParallelConfig, num_layers: int,
                   fixed_order_reduce: bool = False) -> ParallelContext:
        """Rank `rank`'s context in an initialized world of the split's ranks (its numbering:
        each stage's TP ranks consecutive), running its stage's share of `num_layers`. Every
        rank must call it: each creates every stage's TP group, in the same order, as
        torch.distributed requires. `fixed_order_reduce`: see `all_reduce`."""
        tp_size, pp_size = split.tensor_parallel_size, split.pipeline_parallel_size
        tp_rank, pp_rank = split.tp_rank(rank), split.pp_rank(rank)
        layers = split.stage_layers(num_layers, pp_rank)
        tp_group, tp_ranks = None, (rank,)
        for stage in range(pp_size):
            ranks = tuple(range(stage * tp_size, (stage + 1) * tp_size))
            group = dist.new_group(list(ranks)) if tp_size > 1 else None  # tp 1: no collective runs
            if stage == pp_rank:
                tp_group, tp_ranks = group, ranks
        return ParallelContext(
            tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, layers=layers, tp_group=tp_group,
            tp_ranks=tp_ranks, prev_rank=rank - tp_size if pp_rank > 0 else None,
            next_rank=rank + tp_size if pp_rank < pp_size - 1 else None, fixed_order_reduce=fixed_order_reduce,
        )

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the TP ranks, in place (a row-parallel layer's partial outputs). gloo's ring
        adds each slice of the tensor in an order that depends on where the slice falls, so an
        element's sum can change with the row count from three ranks on; with
        `fixed_order_reduce` every rank gathers the parts and adds them in rank order (tp_size
        times the bytes), the same bits for every row count."""
        if self.tp_size == 1:
            return tensor
        start = time.perf_counter()
        if self.fixed_order_reduce:
            parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
            dist.all_gather(parts, tensor.contiguous(), group=self.tp_group)
            tensor.copy_(parts[0])
            for part in parts[1:]:
                tensor.add_(part)
        else:
            dist.all_reduce(tensor, group=self.tp_group)
        self.stats.add(tensor.numel() * tensor.element_size(), time.perf_counter() - start)
        return tensor

    def gather_vocab(self, shard: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """The TP ranks' logits shards [R, V/tp] joined into [R, vocab_size] on the first TP rank
        (which samples); None on the others."""
        if self.tp_size == 1:
            return shard[:, :vocab_size]
        start = time.perf_counter()
        shard = shard.contiguous()
        dst = self.tp_ranks[0]
        parts = [torch.empty_like(shard) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        dist.gather(shard, parts, dst=dst, group=self.tp_group)
        self.stats.add(shard.numel() * shard.element_size(), time.perf_counter() - start)
        return None if parts is None else torch.cat(parts, dim=-1)[:, :vocab_size]

    def send_to_next_stage(self, tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            start = time.perf_counter()
            dist.send(tensor.contiguous(), self.next_rank)
            self.stats.add(tensor.numel() * tensor.element_size(), time.perf_counter() - start, p2p=True)

    def recv_from_prev_stage(self, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
        received = []
        for shape in shapes:
            tensor = torch.empty(shape, dtype=dtype)
            start = time.perf_counter()
            dist.recv(tensor, self.prev_rank)
            self.stats.add(tensor.numel() * tensor.element_size(), time.perf_counter() - start, p2p=True)
            received.append(tensor)
        return received

    def kv_config(self, config: ModelConfig) -> ModelConfig:
        """`config` as this rank's KV cache sees it: its stage's layers, its KV heads."""
        num_layers = config.num_layers if self.layers is None else len(self.layers)
        return dataclasses.replace(config, num_layers=num_layers,
                                   num_kv_heads=len(self.kv_head_range(config.num_kv_heads)))

    def shard_range(self, total: int) -> range:
        """This TP rank's equal share of `total` (heads, rows), as a range."""
        size = total // self.tp_size
        return range(self.tp_rank * size, (self.tp_rank + 1) * size)

    def kv_head_range(self, num_kv_heads: int) -> range:
        """The KV heads this rank holds: its share, or the one head its group of ranks
        replicates when there are more ranks than KV heads (vLLM)."""
        if num_kv_heads >= self.tp_size:
            return self.shard_range(num_kv_heads)
        head = self.tp_rank // (self.tp_size // num_kv_heads)
        return range(head, head + 1)

    def vocab_shard(self, vocab_size: int) -> range:
        """The vocabulary rows of this rank's LM-head shard: ceil(V / tp) each, the last one
        short (its logits are padded for the gather)."""
        size = -(-vocab_size // self.tp_size)
        return range(min(self.tp_rank * size, vocab_size), min((self.tp_rank + 1) * size, vocab_size))


def block_rows(blocks: BlockWeight | None, rows: range) -> BlockWeight | None:
    """Rows `rows` of a GGUF weight (a column-parallel shard): whole rows, so whole blocks."""
    if blocks is None:
        return None
    return BlockWeight(blocks.ggml_type, blocks.blocks[rows.start : rows.stop].contiguous())


def block_columns(blocks: BlockWeight | None, in_features: int, columns: range) -> BlockWeight | None:
    """Input columns `columns` of a GGUF weight of `in_features` columns (a row-parallel
    shard), or None where they do not start and end on block boundaries: the float weight
    then serves alone."""
    if blocks is None or columns.start % GGUF_BLOCK_WEIGHTS or columns.stop % GGUF_BLOCK_WEIGHTS:
        return None
    bytes_per_block = blocks.blocks.shape[1] * GGUF_BLOCK_WEIGHTS // in_features
    start, stop = (column // GGUF_BLOCK_WEIGHTS * bytes_per_block for column in (columns.start, columns.stop))
    return BlockWeight(blocks.ggml_type, blocks.blocks[:, start:stop].contiguous())

"""How the model is split over ranks: tensor parallelism inside a stage, pipeline stages over
the layers (vLLM's numbering: rank = pp_rank * tp_size + tp_rank), and where the ranks run
(nodes, the rendezvous address). Plain data, no torch: the engine plans with it, the workers
build their process groups from it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from chunkserve.config.fields import arg
from chunkserve.errors import InvalidRequestError, ModelLoadError

# the control socket (scheduler outputs to the workers, their results back) listens this far above
# --master-port, where torch.distributed's store listens
CONTROL_PORT_OFFSET = 1


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = arg(
        1, "tensor-parallel ranks: each holds its share of every layer's heads and MLP columns (one all-reduce "
        "after the attention and one after the MLP of every layer)", aliases=("-tp", "--tp", "--tp-size")
    )
    pipeline_parallel_size: int = arg(
        1, "pipeline stages: each runs a consecutive share of the layers, up to this many steps in flight",
        aliases=("-pp", "--pp", "--pp-size")
    )
    nnodes: int = arg(1, "machines the ranks are spread over (each runs tp x pp / nnodes of them)")
    node_rank: int = arg(0, "this machine's index among --nnodes; node 0 runs the engine, the others --headless")
    master_addr: str = arg(
        "127.0.0.1", "node 0's address: torch.distributed's store listens on --master-port there, the engine's "
        "control socket on --master-port + 1"
    )
    master_port: int = arg(29501, "node 0's torch.distributed store port (the control socket takes the next one)")
    pp_layer_partition: tuple[int, ...] | None = arg(
        None, "layers per pipeline stage, comma-separated, first stage first (e.g. 12,18; default: as even as "
        "possible)"
    )

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "nnodes"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.node_rank < self.nnodes:
            raise InvalidRequestError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.world_size % self.nnodes:
            raise InvalidRequestError(
                f"the {self.world_size} ranks (tensor_parallel_size {self.tensor_parallel_size} x "
                f"pipeline_parallel_size {self.pipeline_parallel_size}) do not divide evenly over {self.nnodes} nodes"
            )
        if not 1 <= self.master_port <= 65535 - CONTROL_PORT_OFFSET:
            raise InvalidRequestError(f"master_port must be in [1, {65535 - CONTROL_PORT_OFFSET}], got {self.master_port}")
        partition = self.pp_layer_partition
        if partition is not None:
            if len(partition) != self.pipeline_parallel_size or min(partition) < 1:
                raise InvalidRequestError(
                    f"pp_layer_partition {','.join(map(str, partition))} must give one positive layer count per "
                    f"pipeline stage ({self.pipeline_parallel_size})"
                )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def max_steps_in_flight(self) -> int:
        """The pipeline's depth: each stage holds one step, so up to this many are in flight (the
        engine core, its executor and the scheduler all read it from here)."""
        return self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The ranks whose workers run on this node."""
        return range(self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node)

    @property
    def output_rank(self) -> int:
        """The rank that samples: the last stage's first tensor-parallel rank."""
        return (self.pipeline_parallel_size - 1) * self.tensor_parallel_size

    @property
    def control_port(self) -> int:
        return self.master_port + CONTROL_PORT_OFFSET

    def tp_rank(self, rank: int) -> int:
        return rank % self.tensor_parallel_size

    def pp_rank(self, rank: int) -> int:
        return rank // self.tensor_parallel_size

    def stage_layers(self, num_layers: int, pp_rank: int) -> range:
        """The layers stage `pp_rank` runs: the partition's, or as even as can be, the first
        stages taking one more while the layers do not divide (vLLM's default split)."""
        partition = self.pp_layer_partition
        if partition is None:
            base, extra = divmod(num_layers, self.pipeline_parallel_size)
            partition = tuple(base + (stage < extra) for stage in range(self.pipeline_parallel_size))
        elif sum(partition) != num_layers:
            raise InvalidRequestError(
                f"pp_layer_partition {','.join(map(str, partition))} covers {sum(partition)} layers but the model "
                f"has {num_layers}"
            )
        if min(partition) < 1:
            raise InvalidRequestError(
                f"{num_layers} layers cannot fill {self.pipeline_parallel_size} pipeline stages"
            )
        start = sum(partition[:pp_rank])
        return range(start, start + partition[pp_rank])

    def check_model(self, model: Any) -> None:
        """Refuse at start-up what vLLM refuses: heads that do not divide over the TP ranks
        (KV heads either divide or are replicated), MLP rows that do not; too few layers for
        the stages; a vision-language model on more than one rank (its vision encoder runs on
        one). `model`: the model's shape (a ModelConfig)."""
        tp = self.tensor_parallel_size
        if getattr(model, "multimodal", None) is not None and self.world_size > 1:
            raise ModelLoadError(f"{model.architecture} is a vision-language model, which runs on one rank only: "
                                 "leave --tensor-parallel-size and --pipeline-parallel-size at 1")
        num_heads, num_kv_heads, num_layers = model.num_heads, model.num_kv_heads, model.num_layers
        if num_heads % tp:
            raise InvalidRequestError(
                f"Total number of attention heads ({num_heads}) must be divisible by tensor parallel size ({tp})."
            )
        if num_kv_heads % tp and tp % num_kv_heads:
            raise InvalidRequestError(
                f"Total number of key/value heads ({num_kv_heads}) must be divisible by tensor parallel size "
                f"({tp}), or tensor parallel size by it (then KV heads are replicated)."
            )
        if model.intermediate_size % tp:
            raise InvalidRequestError(
                f"The MLP's intermediate size ({model.intermediate_size}) must be divisible by tensor parallel size "
                f"({tp})."
            )
        for stage in range(self.pipeline_parallel_size):
            self.stage_layers(num_layers, stage)


def under_torchrun() -> bool:
    """torchrun started this process; its agent hosts the store on MASTER_PORT."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def store_prefix() -> str:
    """The key prefix of our ranks in torch.distributed's store: under torchrun, whose agent keeps
    its store across restarts, one per run and attempt, so that a restart never meets old keys."""
    if not under_torchrun():
        return "chunkserve"
    env = os.environ
    return f"chunkserve/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def parse_layer_partition(text: str | None) -> tuple[int, ...] | None:
    """'10,20' -> (10, 20): the --pp-layer-partition flag."""
    if text is None or not text.strip():
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise InvalidRequestError(f"pp_layer_partition must be comma-separated layer counts, got {text!r}") from None

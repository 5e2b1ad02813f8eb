"""A worker: one model replica, or one rank's shard of it, and its KV cache. It owns what
touches tensors (loading the model, sizing and allocating the KV pool, choosing the ops) and
runs the steps the executor hands it. With one process there is one worker; the
multiprocess executor runs one per rank, each answering the same calls, joined by
torch.distributed (gloo)."""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import time

import torch
import torch.distributed as dist

from chunkserve.config.engine import EngineArgs
from chunkserve.config.model import ModelSource, resolve_model
from chunkserve.config.parallel import store_prefix
from chunkserve.core.kv.layout import ModelFingerprint
from chunkserve.core.kv_connector import KVConnectorWorker
from chunkserve.core.kv_connector_factory import build_worker_side
from chunkserve.core.messages import ModelRunnerOutput, NewRequestData, ScheduledRequest, SchedulerOutput
from chunkserve.core.stats import RankStepStats
from chunkserve.core.step_predictor import observed_step_seconds
from chunkserve.errors import InvalidRequestError
from chunkserve.model.config import ModelConfig
from chunkserve.model.fingerprint import model_fingerprint
from chunkserve.model.llama import LlamaModel
from chunkserve.model.loader import TORCH_DTYPES, load_model, load_model_config
from chunkserve.model.parallel import ParallelContext
from chunkserve.model.vlm.encoder import VisionEncoder
from chunkserve.sampling_params import SamplingParams
from chunkserve.worker.draft_model import DraftModelProposer
from chunkserve.worker.kv_cache import kv_bytes_per_token, num_blocks_for_memory
from chunkserve.worker.model_runner import ModelRunner


# how long a collective may wait for a peer before it fails (a peer that died closes its sockets first)
DIST_TIMEOUT = datetime.timedelta(minutes=5)


class Worker:
    def __init__(self, config: EngineArgs, kv_connector: KVConnectorWorker | None = None, rank: int = 0) -> None:
        """`rank`: this worker's rank among tensor_parallel_size x pipeline_parallel_size; with
        more than one, it joins the others' torch.distributed group here (every rank must)."""
        self.config = config
        self.rank = rank
        self.source: ModelSource = resolve_model(config.model)
        self.model_config: ModelConfig = load_model_config(self.source)
        self.parallel_config = config.parallel_config()
        self.parallel_config.check_model(self.model_config)
        self.parallel = self._join_world() if self.parallel_config.world_size > 1 else ParallelContext.single()
        self.kv_connector = kv_connector
        self.model: LlamaModel | None = None
        self.speculative = config.speculative()
        self.draft_source: ModelSource | None = None
        self.draft_config: ModelConfig | None = None
        if self.speculative is not None and self.speculative.drafts_in_worker:
            self.draft_source = resolve_model(self.speculative.model)
            self.draft_config = load_model_config(self.draft_source)
        self.drafter: DraftModelProposer | None = None
        self.encoder: VisionEncoder | None = None  # a vision-language model's vision tower and projector
        self.runner: ModelRunner | None = None
        self.num_blocks = 0

    def _join_world(self) -> ParallelContext:
        parallel = self.parallel_config
        store = dist.TCPStore(parallel.master_addr, parallel.master_port, parallel.world_size, is_master=False,
                              timeout=DIST_TIMEOUT)
        dist.init_process_group("gloo", store=dist.PrefixStore(store_prefix(), store), rank=self.rank,
                                world_size=parallel.world_size, timeout=DIST_TIMEOUT)
        return ParallelContext.from_world(self.rank, parallel, self.model_config.num_layers,
                                          fixed_order_reduce=self.config.deterministic)

    @property
    def kv_config(self) -> ModelConfig:
        """The shape of this rank's KV: its stage's layers and its KV heads."""
        return self.parallel.kv_config(self.model_config)

    def determine_num_kv_blocks(self) -> int:
        """KV blocks that fit the KV memory (`kv_cache_bytes`; per rank: its share of the KV; with a draft
        model, the draft's KV of every block too), or exactly `num_kv_blocks`."""
        config = self.config
        if config.num_kv_blocks:
            return config.num_kv_blocks
        dtype = TORCH_DTYPES[config.dtype]
        per_token = kv_bytes_per_token(self.kv_config, dtype)
        if self.draft_config is not None:
            per_token += kv_bytes_per_token(self.draft_config, dtype)
        return num_blocks_for_memory(per_token, config.kv_cache_bytes, config.block_size)

    def load_model(self, max_model_len: int) -> None:
        self.model = load_model(self.source, self.model_config, self.config.dtype, max_model_len, self.parallel,
                                self.config.int8_activations)
        if self.model_config.multimodal is not None:  # (load_model refused it on several ranks)
            self.encoder = VisionEncoder.from_folder(self.source.path, self.model_config)
        if self.draft_config is not None:
            if self.draft_config.max_position_embeddings < max_model_len:
                raise InvalidRequestError(f"the draft model's limit ({self.draft_config.max_position_embeddings} "
                                          f"tokens) is below max_model_len ({max_model_len})")
            draft = load_model(self.draft_source, self.draft_config, self.config.dtype, max_model_len)
            self.drafter = DraftModelProposer(draft, self.draft_config, self.model_config.vocab_size, max_model_len)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV pool and the runner over it (after `load_model`); with
        `enable_hierarchical_cache`, the disk KV tier's worker side goes with it."""
        assert self.model is not None, "load_model first"
        config = self.config
        self.num_blocks = num_blocks
        if self.kv_connector is None:  # the connector the flags ask for (the engine core builds its other side)
            self.kv_connector = build_worker_side(config.kv_connector_config(), self.kv_fingerprint)
        self.runner = ModelRunner(self.model, self.model_config, num_blocks, config.block_size, config.seed,
                                  config.op_backend, self.kv_connector, self.kv_config,
                                  tokens_from_steps=config.tokens_from_steps, drafter=self.drafter,
                                  encoder=self.encoder, deterministic=config.deterministic)
        _return_freed_memory()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The runner's output, with this rank's compute and communication for the step."""
        start = time.perf_counter()
        try:
            output = self.runner.execute(scheduler_output)
        finally:
            comm = self.parallel.stats.take()
        output.rank_stats = [RankStepStats(self.rank, time.perf_counter() - start, comm.count, comm.bytes,
                                           comm.seconds, comm.p2p_seconds)]
        return output

    def shutdown(self) -> None:
        """Stop the KV connector's threads (the engine settled its work first) and leave the
        process group."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()

    def kv_fingerprint(self) -> ModelFingerprint:
        """What KV this worker writes: its model's weights, tokenizer and KV layout."""
        return model_fingerprint(self.source, self.model_config, self.config.dtype, self.config.block_size)

    def read_kv_blocks(self, block_ids: list[int]) -> list[bytes]:
        return self.runner.read_kv_blocks(block_ids)

    def write_kv_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        self.runner.write_kv_blocks(block_ids, payloads)

    def generator_state(self, request_id: str) -> bytes | None:
        return self.runner.generator_state(request_id)

    def profile(self, rows: list[tuple[int, int]], seed: int = 0) -> float:
        """Run one step of made-up requests, a (start position, tokens) pair each, and return
        its seconds (a pipeline stage's own). Their KV lands in blocks 0.. of the pool, so the engine calls this only
        while no request holds blocks (and drops its prefix cache first)."""
        block_size = self.config.block_size
        rng = torch.Generator().manual_seed(seed)
        scheduled, new = [], []
        for index, (start, num_tokens) in enumerate(rows):
            length = start + num_tokens
            if not (0 < num_tokens and length <= self.num_blocks * block_size):
                raise InvalidRequestError(f"synthetic request ({start}, {num_tokens}) does not fit the KV pool")
            request_id = f"synthetic-{index}"
            prompt = torch.randint(self.model_config.vocab_size, (length,), generator=rng).tolist()
            new.append(NewRequestData(request_id, prompt, SamplingParams(max_tokens=1), None))
            blocks = list(range(-(-length // block_size)))
            scheduled.append(ScheduledRequest(request_id, start, num_tokens, blocks, True, True, num_tokens == 1))
        output = self.execute_model(SchedulerOutput(scheduled, new))  # (timed inside)
        self.runner.execute(SchedulerOutput([], [], finished_request_ids={r.request_id for r in new}))
        return observed_step_seconds(output.rank_stats, self.parallel_config.pipeline_parallel_size,
                                     output.rank_stats[0].compute_s)


def _return_freed_memory() -> None:
    """Hand the heap pages freed while loading (the dequantized checkpoint, the weights the
    packing replaced) back to the system. glibc keeps freed blocks below its mmap threshold in
    the heap, which that threshold grows to after the first large free, so without this a
    worker stays a few hundred MB larger than what it holds. Nothing to do elsewhere."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)

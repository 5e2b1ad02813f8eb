"""An executor with no model: every sampled row gets a made-up token at once.

It runs the engine core's real scheduling, KV accounting and messaging at no model cost, for
measuring what the core itself costs (benchmarks/engine/step_message_bytes.py) and for tests of the
core without weights. Its tokens are a fixed function of the request's history, so a run is
reproducible; they never include the model's EOS unless the vocabulary is that small."""

from __future__ import annotations

from typing import Any

from chunkserve.core.messages import ModelRunnerOutput, SchedulerOutput
from chunkserve.executor.base import Executor
from chunkserve.model.config import ModelConfig


class SimulatedExecutor(Executor):
    def __init__(self, model_config: ModelConfig, num_blocks: int) -> None:
        self.model_config = model_config
        self.num_blocks = num_blocks
        self._num_tokens: dict[str, int] = {}  # each request's history length, as a worker keeps it

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        if method == "determine_num_kv_blocks":
            return [self.num_blocks]
        if method in ("load_model", "initialize_kv_cache"):
            return [None]
        raise NotImplementedError(f"the simulated executor has no {method!r} (it runs no model and times nothing)")

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in scheduler_output.finished_request_ids:
            self._num_tokens.pop(request_id, None)
        for new in scheduler_output.new_requests:
            self._num_tokens[new.request_id] = len(new.prompt_token_ids)
        sampled = {}
        for s in scheduler_output.scheduled:
            if s.sample:
                length = self._num_tokens[s.request_id]
                sampled[s.request_id] = [self.token_at(length)]
                self._num_tokens[s.request_id] = length + 1
        return ModelRunnerOutput(sampled)

    def token_at(self, position: int) -> int:
        """The token a request samples at `position`: in [1, vocab), skipping the low ids
        where tokenizers keep their special tokens."""
        vocab = self.model_config.vocab_size
        low = min(1000, vocab // 2)
        return low + (position * 7919) % (vocab - low)
